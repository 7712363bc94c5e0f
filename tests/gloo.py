"""Helpers for tests that spawn gloo ranks on the CPU (`torch.multiprocessing.spawn`)."""

import socket


def free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

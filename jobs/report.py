"""Machine-readable output of the jobs."""

import json
import os
import sys


def emit_json_line(result: dict) -> None:
    """One JSON line on stdout, written to fd 1 directly: vllm decorates `sys.stdout.write` with a
    "(DiffusionWorker pid=…)" prefix in the process that runs an engine."""
    sys.stdout.flush()
    os.write(1, (json.dumps(result) + "\n").encode())

"""API keys of the HTTP API: where they come from (an environment variable, a file; never the config itself) and
the check of a request's `Authorization: Bearer <key>` header.

Only the keys' SHA-256 digests reach the ingress replica (its constructor's arguments are the application's, which
Serve keeps and shows); a presented key is hashed and compared with every digest in constant time, as vllm's
`--api-key` check compares keys."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from app.config import ConfigError, ServeConfig

OPEN_PATHS = ("/v1/health",)  # answered without a key: load balancers and probes poll it
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def load_keys(settings: ServeConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The API keys `settings` names: the environment variable's (comma-separated) and the file's (one a line, `#`
    comments); empty: the API is open."""
    keys = [k.strip() for k in environ.get(settings.api_key_env, "").split(",") if k.strip()]
    if settings.api_key_file:
        path = Path(settings.api_key_file).expanduser()
        if not path.is_file():
            raise ConfigError(f"serve.api_key_file={settings.api_key_file}: no such file (one API key a line)")
        lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
        from_file = [line for line in lines if line]
        if not from_file:
            raise ConfigError(f"serve.api_key_file={settings.api_key_file} holds no key (one API key a line)")
        keys += from_file
    if any(len(k) < 16 for k in keys):
        raise ConfigError(f"an API key from {settings.api_key_env} or serve.api_key_file is shorter than 16 "
                          "characters: use a long random one "
                          "(python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return keys


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyCheck:
    """Whether a request may pass: no keys (an open API), or a bearer key whose digest is one of `digests`."""

    def __init__(self, digests: list[str]):
        self.digests = list(digests)

    @property
    def required(self) -> bool:
        return bool(self.digests)

    def problem(self, authorization: str | None) -> str | None:
        """None when the `Authorization` header's key is accepted, else what is wrong (the 401's message)."""
        if not self.required:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return "no API key: send the header `Authorization: Bearer <key>` (the openai client's api_key=)"
        presented = digest(key.strip())
        matched = False
        for known in self.digests:  # every digest compared: the time says nothing about which one matched
            matched |= hmac.compare_digest(presented, known)
        return None if matched else "the API key is not valid"

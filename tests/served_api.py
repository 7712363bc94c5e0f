"""What the family HTTP tests (on the applications the jobs leave serving, tests/test_train_job_<family>.py) ask the
HTTP API the same way."""

import json

import requests


def generate(url: str, **body):
    """POST /v1/images/generations of a sign prompt (unless `body` names another), as a user's client sends it."""
    return requests.post(f"{url}/v1/images/generations", json={"prompt": 'a sign that says "OPEN"', **body},
                         timeout=120)


def trajectory_metadata(raw: bytes) -> dict:
    """The scalar fields of a returned trajectory (safetensors' header metadata)."""
    return json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]

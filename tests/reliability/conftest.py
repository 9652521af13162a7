"""Reliability tests: faults, fuzzing and security, and an S3-compatible store on loopback. Hypothesis runs a
small, fixed set of examples by default (`HYPOTHESIS_PROFILE=deep` for a long search), and keeps no example
database in the repository."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings

# a failing example is reported as found (with its reproduce blob), not shrunk: shrinking can take minutes
settings.register_profile(
    "llmops", max_examples=8, deadline=None, derandomize=True, database=None, print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
settings.register_profile("deep", parent=settings.get_profile("llmops"), max_examples=400, derandomize=False,
                          phases=list(Phase))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "llmops"))


@pytest.fixture
def s3_bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A bucket on a moto server on 127.0.0.1, reachable from this process and its children (by environment)."""
    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION":
                        "us-east-1", "AWS_ENDPOINT_URL_S3": endpoint}.items():
        monkeypatch.setenv(name, value)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="store")
    yield "s3://store"
    server.stop()

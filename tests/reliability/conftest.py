"""Fixtures of the reliability tests: an S3-compatible store on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


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

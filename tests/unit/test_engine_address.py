"""A Ray cluster address the stages cannot work through ends the run in one line before Ray tries it: Ray retries a
host:port where nothing answers for minutes, and a Ray Client (ray://) driver cannot run Ray Data or Ray Train."""

from __future__ import annotations

import socket
import time

import pytest

from llmops.io.errors import ConfigError
from llmops.pipeline.engine import refuse_address


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_address_where_nothing_answers_is_one_line_in_seconds() -> None:
    port = closed_port()
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        refuse_address(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 5
    assert str(raised.value) == (f"engine: ray: nothing answers at 127.0.0.1:{port} (Connection refused); start the "
                                 "cluster there (ray start --head) or correct engine.address / RAY_ADDRESS")


def test_an_address_that_answers_and_the_forms_ray_reads_itself_pass() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        refuse_address(f"127.0.0.1:{server.getsockname()[1]}")
    refuse_address("auto")


def test_a_ray_client_address_is_refused_with_what_to_do_instead() -> None:
    with pytest.raises(ConfigError, match=r"^engine: ray: ray://user:\*\*\*@head:10001 is a Ray Client address, "
                                          r"which cannot drive Ray Data or Ray Train; .*ray job submit -- llmops run"):
        refuse_address("ray://user:secret@head:10001")

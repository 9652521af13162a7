"""Real servers on loopback for fault tests, and a TCP forwarder in front of one that can cut it off."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.stack import free_port, wait_for

BIN = Path(sys.executable).parent


def start_mlflow(root: Path) -> tuple[subprocess.Popen, int]:
    """An MLflow server with a SQLite store and a proxied artifact folder under `root`."""
    port = free_port()
    log = (root / "mlflow-server.log").open("w")
    process = subprocess.Popen([str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
                                "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                                "--artifacts-destination", str(root / "mlflow-artifacts"), "--workers", "1"],
                               stdout=log, stderr=subprocess.STDOUT,
                               # no job runner and its consumer processes
                               env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    wait_for(f"http://127.0.0.1:{port}/health", process, seconds=300)
    return process, port


class LoopbackProxy:
    """Forwards 127.0.0.1:`port` to a server. `cut()` makes the server unreachable as a crash would (new
    connections refused, open ones dropped); `restore()` brings it back on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target, self.port = target_port, free_port()
        self.listener: socket.socket | None = None
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.restore()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        if self.listener is not None:
            return  # not cut
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self.accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        if self.listener is not None:
            close(self.listener)  # shutdown first: a close alone leaves a socket blocked in accept() listening
            self.listener = None
        with self.lock:
            for connection in list(self.open):
                close(connection)
            self.open.clear()

    def restore_after(self, seconds: float) -> threading.Thread:
        def later() -> None:
            time.sleep(seconds)
            self.restore()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread

    def accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                close(client)
                continue
            with self.lock:
                self.open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self.pump, args=(source, sink), daemon=True).start()

    def pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            close(source)
            close(sink)


def close(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
    connection.close()

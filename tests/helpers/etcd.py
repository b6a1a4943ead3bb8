"""A real etcd server on 127.0.0.1 for torchrun's etcd-v2 rendezvous: Debian's etcd-server, stopped by pid.

etcd 3.4 serves the v2 API that torch's etcd-v2 backend (through python-etcd) speaks only with
``--enable-v2=true``. One member, a temporary data directory, free client and peer ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers import procs
from tests.helpers.agents import free_port
from tests.helpers.debian import debian_binary

ETCD = "/usr/bin/etcd"
STOP_TIMEOUT_S = 10


class EtcdServer:
    """``endpoint`` is host:port for ``--rdzv-endpoint``; ``stop()`` ends and reaps the server."""

    def __init__(self, workdir: Path) -> None:
        binary, reason = debian_binary(ETCD, "etcd-server")
        assert binary is not None, reason
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        self.endpoint = client.removeprefix("http://")
        self.launched = procs.launch(
            [
                binary, "--name=test", f"--data-dir={workdir / 'etcd-data'}", "--enable-v2=true",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}", "--log-level=warn",
            ],
            log_path=workdir / "etcd.log",
        )
        self._wait_healthy(f"{client}/health")

    def _wait_healthy(self, url: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.launched.proc.poll() is not None:
                raise AssertionError(f"etcd exited with code {self.launched.proc.returncode}:\n{self.launched.output()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if b'"health":"true"' in response.read():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd not healthy after {timeout_s} s:\n{self.launched.output()[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM by pid, SIGKILL if it lingers; reaped either way."""
        proc = self.launched.proc
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

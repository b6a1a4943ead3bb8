"""A real ``mlflow server`` on 127.0.0.1 (SQLite backend) for the tracking tests, stopped by pid with its children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.helpers import procs
from tests.helpers.prometheus import free_port
from tests.helpers.s3 import _die_with_parent

START_S = 120.0  # the first start creates the SQLite schema (alembic migrations): slow on a loaded machine


class MlflowServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "mlflow-server.log"
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
                   "--default-artifact-root", str(workdir / "artifacts")]
        # Without MLflow's job runner: the tests need none, and it leaves a directory in /dev/shm behind per start.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                         cwd=workdir, start_new_session=True, preexec_fn=_die_with_parent, env=env)
        self.children: set[int] = set()
        self._wait_until_serving()

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            self.children |= set(procs.descendants(self.proc.pid))
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        self.children |= set(procs.descendants(self.proc.pid))
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"mlflow server not serving after {START_S} s:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def hang(self) -> None:
        """SIGSTOP the server and its children (its session's process group): connections open, nothing answered."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def wake(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM the server, SIGKILL it after a grace period, then every child it had (by pid), and reap it."""
        self.children |= set(procs.descendants(self.proc.pid))
        if self.proc.poll() is None:
            self.wake()  # a stopped process would not act on the SIGTERM
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.children:
            if procs.pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(procs.pid_alive(pid) for pid in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in self.children if procs.pid_alive(pid)], "mlflow server children survived SIGKILL"

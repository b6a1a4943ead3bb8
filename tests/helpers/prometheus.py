"""A real Prometheus server on 127.0.0.1 for tests: installed from Debian if missing, stopped by pid.

``prometheus_binary()`` finds ``/usr/bin/prometheus`` or installs Debian's ``prometheus`` package
(as root, with apt-get), and says why not otherwise; a test skips with that reason. ``Prometheus``
starts the server with a generated config (1 s scrapes, a temporary TSDB, a free port) and
queries it over its HTTP API, the way a dashboard does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import procs
from tests.helpers.debian import debian_binary

PROMETHEUS = "/usr/bin/prometheus"
PROMTOOL = "/usr/bin/promtool"
STOP_TIMEOUT_S = 10


def prometheus_binary() -> tuple[str | None, str]:
    """(path to prometheus, "") or (None, why it cannot be had); installs the Debian package at most once."""
    return debian_binary(PROMETHEUS, "prometheus")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape_config(job_name: str, targets: list[str]) -> dict[str, Any]:
    return {"job_name": job_name, "static_configs": [{"targets": targets}]}


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping ``scrape_configs`` every second; ``stop()`` ends and reaps it."""

    def __init__(self, binary: str, workdir: Path, scrape_configs: list[dict[str, Any]]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"}, "scrape_configs": scrape_configs}
        config_path = workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        (workdir / "tsdb").mkdir(exist_ok=True)
        self.launched = procs.launch(
            [
                binary, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
            ],
            log_path=workdir / "prometheus.log",
        )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.launched.proc.poll() is not None:
                raise AssertionError(f"prometheus exited with code {self.launched.proc.returncode}:\n{self.launched.output()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus not ready after {timeout_s} s:\n{self.launched.output()[-3000:]}")
            time.sleep(0.1)

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant vector ``expression`` evaluates to now (``[{"metric": labels, "value": [t, "v"]}, ...]``)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for_value(self, expression: str, timeout_s: float = 20.0) -> float:
        """Poll until ``expression`` has exactly one sample (after a scrape or two) and return its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expression)
            if len(result) == 1:
                return float(result[0]["value"][1])
            if time.monotonic() > deadline:
                targets = urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5).read().decode()
                raise AssertionError(f"{expression!r} gave {result} after {timeout_s} s; targets: {targets[:2000]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM by pid (Prometheus shuts its TSDB down cleanly), SIGKILL if it lingers; reaped either way."""
        proc = self.launched.proc
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()

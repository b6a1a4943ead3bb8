"""Servers the tests need from Debian's packages (prometheus, etcd-server): found, or installed once with apt-get."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

INSTALL_TIMEOUT_S = 600

_outcomes: dict[str, tuple[str | None, str]] = {}  # package -> (path or None, reason), decided once per session


def debian_binary(path: str, package: str) -> tuple[str | None, str]:
    """(path, "") or (None, why it cannot be had); installs ``package`` at most once per session."""
    if package not in _outcomes:
        _outcomes[package] = _find_or_install(path, package)
    return _outcomes[package]


def _find_or_install(path: str, package: str) -> tuple[str | None, str]:
    if os.path.exists(path):
        return path, ""
    if shutil.which("apt-get") is None:
        return None, f"{path} is missing and there is no apt-get to install Debian's {package} package"
    if os.geteuid() != 0:
        return None, f"{path} is missing; installing it needs root: apt-get install -y {package}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    started = time.monotonic()
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", package]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None, f"`{' '.join(command)}` did not finish in {INSTALL_TIMEOUT_S} s"
        if done.returncode != 0:
            last_line = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return None, f"`{' '.join(command)}` failed with code {done.returncode}: {last_line}"
    print(f"installed Debian's {package} package in {time.monotonic() - started:.1f} s")
    return (path, "") if os.path.exists(path) else (None, f"the {package} package installed no {path}")

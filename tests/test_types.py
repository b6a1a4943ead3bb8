"""The package passes the type checker, the linter and the formatter's check, with the settings in pyproject.toml
([tool.mypy], [tool.ruff]).

Each runs in a process of its own from the repository root. mypy keeps its cache in ``.mypy_cache``: the first run
on a fresh checkout reads torch's stubs (about 20 s of CPU), later runs recheck only what changed (under a second).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The tool installed next to this interpreter, run on the package from the repository root."""
    tool = Path(sys.executable).with_name(name)
    return subprocess.run([str(tool), *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_package_type_checks():
    done = run_tool("mypy")  # the files and settings: [tool.mypy]
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_passes_the_linter():
    done = run_tool("ruff", "check", "--no-cache", "elastictrain")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_package_is_formatted():
    done = run_tool("ruff", "format", "--check", "--no-cache", "elastictrain")
    assert done.returncode == 0, done.stdout + done.stderr + "(run: ruff format elastictrain)"

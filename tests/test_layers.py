"""The import contracts in pyproject.toml ([tool.importlinter]; docs/design.md, "Layers") hold, and they bite.

``lint-imports`` runs in a process of its own (a quarter of a second): grimp finds the package by its import path,
so the second test points it at a copy of the package with one import added.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = {
    "torch": "The launcher side, the config and the snapshot store never import torch",
    "layers": "Imports point down the layers",
    "acyclic": "No import cycles between modules",
}


def lint_imports(package_parent: Path) -> tuple[int, set[str], str]:
    """Run the contracts on the package found under ``package_parent``: (exit code, broken contracts' keys, output)."""
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    done = subprocess.run([str(lint), "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    broken = {key for key, name in CONTRACTS.items() if re.search(rf"^{re.escape(name)} BROKEN$", output, re.M)}
    return done.returncode, broken, output


def test_the_package_keeps_every_contract():
    code, broken, output = lint_imports(ROOT)
    assert (code, broken) == (0, set()), output
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in output, output


@pytest.mark.parametrize("module, line, expected", [
    ("core/config.py", "import torch", {"torch"}),  # the config is read before any worker imports torch
    ("storage/manifest.py", "from elastictrain.observe import plots", {"layers"}),  # reaching up, without a cycle
    ("core/errors.py", "from elastictrain.storage import manifest", {"layers", "acyclic"}),  # up, and back down
    ("core/errors.py", "from elastictrain.core import fatal", {"acyclic"}),  # errors <-> fatal: the hook's old cycle
    ("snapshot/restore.py", "from elastictrain.snapshot.durable_tier import DurableTier", {"acyclic"}),  # restore back up to its caller
])
def test_one_import_added_breaks_its_contract(tmp_path, module, line, expected):
    copy = tmp_path / "elastictrain"
    shutil.copytree(ROOT / "elastictrain", copy, ignore=shutil.ignore_patterns("__pycache__"))
    source = copy / module
    text = source.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    assert sep, f"{module} has no __future__ import to add the line after"
    source.write_text(f"{head}{sep}{line}\n{rest}")
    code, broken, output = lint_imports(tmp_path)
    assert (code, broken) == (1, expected), output

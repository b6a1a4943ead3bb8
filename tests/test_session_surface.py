"""The Session's public surface is small, documented, and the only one its clients use.

``Trainer`` (train/trainer.py), ``StepRunner`` (train/step_runner.py), the examples and the benchmarks are read as source (an AST
scan): every ``session.<name>`` they touch must be one of ``PUBLIC``, the names the custom-loop guide tables. The
Session class itself must define exactly those names without a leading underscore, so a new public attribute is a
decision made here and in the guide, not an accident.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from elastictrain.train.runner_link import StepSession
from elastictrain.train.session import Session

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guides" / "custom-loops.md"

PUBLIC = {
    # SETUP
    "wrap", "register", "loader", "val_loader", "evaluate_with", "every_epoch", "on",
    # RESTORE and TRAIN
    "restore", "registered", "epochs", "autocast", "log", "gradients_ok", "step", "rank_state_final", "runner_link",
    # collectives
    "all_reduce", "all_gather", "broadcast", "reduce_metrics",
    # where the run is (read-only)
    "config", "progress", "history", "run_log", "goodput", "global_step", "epoch", "device", "rank", "world_size",
    "is_main", "done", "summary", "grad_accum_steps", "total_steps",
}
CLIENTS = [ROOT / "elastictrain" / "train" / "trainer.py", ROOT / "elastictrain" / "train" / "step_runner.py",
           *sorted((ROOT / "examples").glob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
# A benchmark that measures an internal says so with a private name; each such look is listed here.
LOOKS_INSIDE = {("snapshot_cost.py", "_restoring")}  # the staging buffers' size


def session_accesses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every ``session.<name>`` and ``<x>.session.<name>`` in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "session") or \
                (isinstance(owner, ast.Attribute) and owner.attr == "session"):
            found.append((node.lineno, node.attr))
    return found


def test_the_session_defines_exactly_the_public_names():
    defined = {name for cls in Session.__mro__[:-1] for name in vars(cls) if not name.startswith("_")}  # with its bases
    assert defined == PUBLIC, f"new public: {sorted(defined - PUBLIC)}; gone: {sorted(PUBLIC - defined)}"


def test_a_step_runner_is_typed_against_public_names_only():
    used = {name for name in vars(StepSession) if not name.startswith("_")}
    assert used and used <= PUBLIC, sorted(used - PUBLIC)


def test_every_public_name_is_in_the_guides_table():
    calls = "\n".join(line for line in GUIDE.read_text().splitlines() if line.startswith("| `"))
    missing = [name for name in sorted(PUBLIC) if not re.search(rf"`(session\.)?{name}\b", calls)]
    assert not missing, f"{GUIDE.name}'s tables do not name {missing}"


@pytest.mark.parametrize("path", CLIENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_clients_use_the_public_surface_only(path):
    internal = [(line, name) for line, name in session_accesses(path.read_text())
                if name not in PUBLIC and (path.name, name) not in LOOKS_INSIDE]
    assert not internal, f"{path.relative_to(ROOT)} reaches into the session: {internal}"


def test_the_scan_sees_an_internal_access():
    source = "def f(self, session):\n    session.step()\n    return self.session._health, session.cfg\n"
    assert sorted(session_accesses(source)) == [(2, "step"), (3, "_health"), (3, "cfg")]

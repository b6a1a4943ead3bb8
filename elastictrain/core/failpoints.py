"""Named places where a test can stop a worker at the worst moment, as etcd's gofail does.

A test that must SIGKILL rank 0 *while* a snapshot is being written cannot rely on timing: a
snapshot of the test task takes milliseconds. Instead it sets ``ELASTICTRAIN_FAILPOINT`` to
``<name>@<step>:<dir>`` and the worker, on reaching that failpoint at that step the first time,
writes its pid to ``<dir>/failpoint-<name>.pid`` and waits, so the test's kill or signal lands
exactly there; it goes on when the test creates ``<dir>/failpoint-<name>.resume``. The pid file
makes it fire once per job, not again in the restarted attempt. ``ELASTICTRAIN_FAILPOINT_RANK``
set too, only that rank stops there.
Unset (always, outside tests), ``hit`` is one dictionary lookup.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "ELASTICTRAIN_FAILPOINT"
RANK_ENV = "ELASTICTRAIN_FAILPOINT_RANK"
PAUSE_S = 600.0


def hit(name: str, step: int) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, directory = spec.partition(":")
    wanted_name, _, wanted_step = target.partition("@")
    if wanted_name != name or (wanted_step and int(wanted_step) != step):
        return
    if os.environ.get(RANK_ENV, os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    marker = Path(directory or ".") / f"failpoint-{name}.pid"
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    resume = marker.with_suffix(".resume")
    deadline = time.monotonic() + PAUSE_S
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the test kills or signals this process here


FAULT_ENV = "ELASTICTRAIN_FAULT"
FAULT_RANK_ENV = "ELASTICTRAIN_FAULT_RANK"


def corrupt_gradients(params: list, step: int) -> None:
    """Tests of self-healing: ``ELASTICTRAIN_FAULT=grad-inf@<step>:<dir>`` sets one gradient element to inf on
    rank ``ELASTICTRAIN_FAULT_RANK`` (default 0; ``all``: every rank) after the all-reduce at that step, once per job (the marker
    ``<dir>/fault-grad-inf.done``): a transient fault. ``grad-inf@<step>+`` does it at every step from there
    on, every attempt: a persistent one."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    target, _, directory = spec.partition(":")
    name, _, at = target.partition("@")
    persistent = at.endswith("+")
    first = int(at.rstrip("+"))
    if name != "grad-inf" or os.environ.get(FAULT_RANK_ENV, "0") not in ("all", os.environ.get("RANK", "0")):
        return
    if step < first or (not persistent and step != first):
        return
    marker = Path(directory or ".") / "fault-grad-inf.done"
    if not persistent:
        if marker.exists():
            return
        marker.write_text(str(step))
    grad = next(p.grad for p in params if p.grad is not None)
    grad.view(-1)[0] = float("inf")

"""Run an example script unchanged, with pause points in ``Session.step`` for kill and preemption tests.

    torchrun ... tests/helpers/paused_example.py examples/gan.py [overrides]

``EXAMPLE_PAUSES="RANK@STEP,..."`` and ``EXAMPLE_PAUSE_DIR``: rank RANK, on calling ``session.step()``
for step STEP (its optimizer steps done, the step not yet counted), writes its pid to
``paused-rank{RANK}-step{STEP}.pid`` in that directory and waits until
``paused-rank{RANK}-step{STEP}.resume`` exists, so that the test's SIGKILL or signal lands inside
that step. Once per job: the pid file marks that it happened, so the restarted attempt and the
relaunch of the same command go on through it. The example's own code runs as ``__main__``.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from elastictrain.train.session import Session

PAUSE_S = 600.0


def pause(directory: Path, rank: int, step: int) -> None:
    marker = directory / f"paused-rank{rank}-step{step}.pid"
    if marker.exists():
        return
    marker.write_text(str(os.getpid()))
    resume, deadline = marker.with_suffix(".resume"), time.monotonic() + PAUSE_S
    while not resume.exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the test kills or signals this process here


def install(spec: str, directory: Path, rank: int) -> None:
    steps = {int(step) for r, _, step in (point.partition("@") for point in spec.split(",") if point) if int(r) == rank}
    step = Session.step

    def paused_step(session: Session, **values) -> None:
        if session.global_step + 1 in steps:
            pause(directory, rank, session.global_step + 1)
        step(session, **values)

    Session.step = paused_step


if __name__ == "__main__":
    install(os.environ.get("EXAMPLE_PAUSES", ""), Path(os.environ.get("EXAMPLE_PAUSE_DIR", ".")), int(os.environ.get("RANK", "0")))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""Preemption: a signal in, a snapshot out.

``PreemptionSignals`` replaces the handlers of the configured signals (SIGTERM, SIGINT, SIGUSR1
by default) with one that only records which signal came. The loop reads ``requested`` at each
step boundary and puts it into the per-step vote, so every rank agrees on the same step to stop
at; rank 0 then commits a snapshot and the workers exit with ``PREEMPTED_EXIT_CODE``.

Under torchrun the launcher's exit counts as the first of those signals too: ``install`` asks the kernel for
``LAUNCHER_EXIT_SIGNAL`` when the parent (the agent) exits (``PR_SET_PDEATHSIG``). A worker whose agent was
SIGKILLed would otherwise train on as an orphan that nothing restarts or signals again, and hold the other
nodes' agents at the job's end (torch's exit barrier waits 300 s for it); instead the group stops at an agreed
step with a snapshot, as for a preemption of that node, and the other nodes go on without it. A warm-started
worker's parent is the node's preloaded server, not the agent: its client, the process torchrun started, is
the one tied to the agent, and forwards the signal (``launcher/warmstart.py``).

Nothing is done inside the handler itself: a second signal while the snapshot is being written
is recorded and otherwise ignored, so it cannot tear the write. The launcher's own deadline
(torchrun's ``--shutdown-timeout``, SLURM's ``KillWait``, Kubernetes'
``terminationGracePeriodSeconds``) is what ends a worker that cannot finish in time.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterable
from typing import Any

from elastictrain.core.logs import flush_standard_streams
from elastictrain.core.processes import parent_death_signal

log = logging.getLogger("elastictrain")

# 128 + SIGTERM: what a shell reports for a process ended by SIGTERM. torchrun counts it as a
# failed attempt (and restarts if the agent itself is not shutting down), SLURM records the
# job as failed unless it was requeued, and Kubeflow's `restartPolicy: ExitCode` treats
# 128-255 as retryable: every launcher does what it would do for a terminated job, but
# nothing is lost.
PREEMPTED_EXIT_CODE = 143
# Set in a worker the warm-start server forked (launcher/warm_server.py): its parent is that server, not the agent.
WARM_CHILD_ENV = "ELASTICTRAIN_WARM_CHILD"
# What the kernel sends a worker torchrun started when its agent exits: a real-time signal no launcher sends, so
# that it is told from the launcher's SIGTERM. The kernel sends it as each of the agent's threads ends (the first
# while the agent is still the worker's parent); it counts once.
LAUNCHER_EXIT_SIGNAL: int | None = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None


class Preempted(SystemExit):
    """Raised by ``Trainer.fit()`` after a preemption snapshot: the process exits with code 143.

    A SystemExit, so a script's ``trainer.fit()`` ends the program (nothing after it should run
    on a stopped job) without a traceback; catch it to do something else.
    """

    def __init__(self, signal_name: str, step: int) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.signal_name = signal_name
        self.step = step


class SignalledInSetup(Preempted):
    """A configured signal arrived while the rank was still setting up: nothing to snapshot, so it ends now (exit 143).

    Raised by the signal handler itself, wherever the rank is in Python (the rendezvous round polls
    the store rather than block in it, for this reason). ``waiting_for`` names what it waited for, once known.
    """

    def __init__(self, signal_name: str, waiting_for: str = "") -> None:
        super().__init__(signal_name, 0)
        self.waiting_for = waiting_for

    def waiting(self, what: str) -> SignalledInSetup:
        return SignalledInSetup(self.signal_name, what)

    def line(self, rank: str) -> str:
        doing = f"was waiting for {self.waiting_for}" if self.waiting_for else "was still setting up"
        return f"rank {rank} {doing} when {self.signal_name} arrived; nothing to save"


class PreemptionSignals:
    """Record the first of the configured signals; restore the previous handlers on ``uninstall``.

    Installed with ``setting_up=True``, a signal raises ``SignalledInSetup`` at once until ``hold()``
    is called: before the process group has formed there is no snapshot to take, and a rank that
    only recorded the launcher's SIGTERM would go on waiting for a peer that never comes until the
    launcher kills it (torchrun: 30 s later) without a word.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self.names = list(names)
        self.requested: str | None = None
        self.repeats = 0  # further signals after the first, reported once the loop can log
        self._previous: dict[int, Any] = {}
        self._ends_at_once = False
        self._previous_parent_signal: int | None = None
        self.launcher_gone = False  # the launcher exited (LAUNCHER_EXIT_SIGNAL came)

    def install(self, setting_up: bool = False) -> None:
        self._ends_at_once = setting_up
        if threading.current_thread() is not threading.main_thread():
            # Python delivers signals to the main thread only; a fit() in another thread keeps
            # the process's handlers and cannot be preempted gracefully.
            log.warning("Trainer.fit() is not running in the main thread: preemption signals are not handled")
            return
        for name in self.names:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ and WARM_CHILD_ENV not in os.environ
        if self.names and under_agent and LAUNCHER_EXIT_SIGNAL is not None:
            self._previous[LAUNCHER_EXIT_SIGNAL] = signal.signal(LAUNCHER_EXIT_SIGNAL, self._launcher_exited)
            self._previous_parent_signal = parent_death_signal(LAUNCHER_EXIT_SIGNAL)

    def hold(self) -> None:
        """From now on a signal is only recorded, for the loop to stop at an agreed step with a snapshot."""
        self._ends_at_once = False

    def uninstall(self) -> None:
        if self._previous_parent_signal is not None:
            parent_death_signal(self._previous_parent_signal)
            self._previous_parent_signal = None
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def redeliver(self) -> None:
        """After ``uninstall``: send the held signal again, to the handler it had before (by default: the end).

        For a rank whose group broke while the launcher's SIGTERM was held: the preemption snapshot
        it was held for cannot be taken any more, and the launcher waits for this process to end
        before it restarts the group. Left alone, the interpreter's finalization with torch loaded
        takes about 1 s here; the signal's own default action ends the process at once.
        """
        if self.requested is not None and not self._previous:
            flush_standard_streams()
            signal.raise_signal(getattr(signal, self.requested))

    def _launcher_exited(self, signum: int, frame: Any) -> None:
        if not self.launcher_gone:
            self.launcher_gone = True
            self._handle(getattr(signal, "SIGTERM" if "SIGTERM" in self.names else self.names[0]), frame)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested = signal.Signals(signum).name
        else:
            self.repeats += 1
        if self._ends_at_once:
            self._ends_at_once = False  # raised once: the rank's clean-up is not interrupted by a second signal
            raise SignalledInSetup(self.requested)


def requeue_slurm_job(environ: dict[str, str] | None = None) -> None:
    """``scontrol requeue $SLURM_JOB_ID``: the job goes back to the queue and resumes from the snapshot."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    scontrol = shutil.which("scontrol")
    if not job_id or scontrol is None:
        log.warning("preempt.requeue=true but this is not a SLURM job (no SLURM_JOB_ID or scontrol); not requeued")
        return
    result = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True, timeout=60)
    if result.returncode == 0:
        log.info("SLURM job %s requeued; it resumes from the preemption snapshot", job_id)
    else:
        log.error(
            "scontrol requeue %s failed (exit %d): %s", job_id, result.returncode, " ".join(result.stderr.split())
        )

"""``elastictrain-run``: torchrun, with exit codes a supervisor can act on and no traceback.

Run it exactly as torchrun (same flags, same script or ``-m module`` and arguments). It runs
torch's own launcher (``torch.distributed.run``) in this process, and only changes how it ends:

- the agent was signalled (SIGTERM, SIGINT, SIGUSR1, ... in ``--signals-to-handle``): it has
  forwarded the signal and waited ``--shutdown-timeout`` for the workers' preemption snapshot.
  Exit **143**, the code elastictrain's workers exit with after a preemption, whatever the signal.
  torchrun itself exits 1 with torch's ``SignalException`` traceback, which supervisors read as a
  crash.
- a worker met an error no restart can fix (a config key, a session used out of order, a snapshot
  of another model, a crash that repeated at the same step): the agent makes **no restart**, and
  the last line is that error, exit **2** for a config or usage error, 1 otherwise. The worker
  leaves a marker in the agent's run directory (fatal.py); the agent torch's launcher builds here
  reads it when a worker fails, as torch's own agent disables restarts for a wedged worker.
- a worker exited 2 (elastictrain's code for a config or usage error) without a marker: exit **2**.
- any other worker failure: exit 1 with one line naming the ranks and their exit codes (each
  worker's own output, traceback included, is above it), instead of the ``ChildFailedError`` block.
- the rendezvous store cannot be reached (``RendezvousConnectionError``: with c10d, the agent that
  hosted it, pod 0 or the first node, is gone): exit **200** with one line. A code of 128 or more
  is what Kubeflow's ``restartPolicy: ExitCode`` retries, and 200 is no signal's 128+N, so it is
  never read as a kill. The relaunched job resumes from the newest snapshot.
- a worker that is stopped (SIGSTOP, frozen) when the agent stops the group for a restart is
  SIGKILLed at once: it cannot act on torch's SIGTERM, which torch 2.13 follows with 30 s of waiting.
- success: exit 0.

Anything else the launcher raises (a bad flag, a rendezvous that times out) is torch's and keeps
torch's behaviour.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from elastictrain.core.fatal import FatalRecord, marker_path, read_marker
from elastictrain.core.processes import stopped_pids

PREEMPTED_EXIT_CODE = 143  # elastictrain.core.signals.PREEMPTED_EXIT_CODE, without importing the worker side
CONFIG_ERROR_EXIT_CODE = 2  # elastictrain.core.errors.ConfigError.exit_code and UsageError's
FAILED_EXIT_CODE = 1
RENDEZVOUS_LOST_EXIT_CODE = 200
PROG = "elastictrain-run"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError
    from torch.distributed.launcher import api as launcher_api

    args = torchrun.parse_args(argv)
    agent_class = launcher_api.LocalElasticAgent
    fail_fast = _fail_fast(agent_class)
    # What launch_agent() builds, in this process only (mypy forbids assigning to a class name; this replaces it).
    launcher_api.LocalElasticAgent = fail_fast  # type: ignore[misc]
    try:
        torchrun.run(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _say(
            f"{name} forwarded to the workers; exiting {PREEMPTED_EXIT_CODE} (the next launch of the same command "
            "resumes from the newest snapshot)"
        )
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as exc:
        if fail_fast.fatal is not None:
            return _fatal(fail_fast.fatal)
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        return _failed(codes)
    except RendezvousConnectionError:
        return _rendezvous_lost(args)
    finally:
        launcher_api.LocalElasticAgent = agent_class  # type: ignore[misc]  # torch's own class back
    return 0


def _rendezvous_lost(args) -> int:
    _say(
        f"lost the rendezvous store at {args.rdzv_endpoint} ({args.rdzv_backend}): the agent that hosted it "
        f"is gone or unreachable; exiting {RENDEZVOUS_LOST_EXIT_CODE} (retryable: relaunch every node, the job "
        "resumes from the newest snapshot)"
    )
    return RENDEZVOUS_LOST_EXIT_CODE


def _fail_fast(agent_class: type) -> Any:  # a subclass of agent_class, with a class attribute `fatal`
    """torch's agent, restarting no more once a worker of this attempt recorded an error no restart can fix."""

    class FailFastAgent(agent_class):
        fatal: FatalRecord | None = None  # the error that ended the job, for main()'s last line

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                record = self._fatal_of_this_attempt()
                if record is not None:
                    FailFastAgent.fatal = record
                    self._remaining_restarts = 0  # _invoke_run then stops the workers and returns the failure
            return result

        def _stop_workers(self, worker_group: Any) -> None:
            # torch's stop sends SIGTERM and waits 30 s before SIGKILL (2.13 ignores --shutdown-timeout here); a
            # stopped worker cannot act on SIGTERM: a frozen rank whose live peers are on other nodes.
            for pid in stopped_pids(list(self._pcontext.pids().values()) if self._pcontext is not None else []):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            super()._stop_workers(worker_group)

        def _fatal_of_this_attempt(self) -> FatalRecord | None:
            restart = self._worker_group.spec.max_restarts - self._remaining_restarts
            error_files = getattr(self._pcontext, "error_files", None) or {}
            marker = marker_path(
                {
                    "TORCHELASTIC_ERROR_FILE": next(iter(error_files.values()), ""),
                    "TORCHELASTIC_RESTART_COUNT": str(restart),
                }
            )
            record = read_marker(marker) if marker is not None else None
            return record if record is not None and record.restart == restart else None

    return FailFastAgent


def exit_code_for(worker_exit_codes: dict[int, int]) -> int:
    """The launcher's exit code when workers failed: 2 if any had a config or usage error, else 1."""
    return CONFIG_ERROR_EXIT_CODE if CONFIG_ERROR_EXIT_CODE in worker_exit_codes.values() else FAILED_EXIT_CODE


def _failed(worker_exit_codes: dict[int, int]) -> int:
    code = exit_code_for(worker_exit_codes)
    described = ", ".join(f"rank {rank} {_describe(exit_code)}" for rank, exit_code in worker_exit_codes.items())
    if code == CONFIG_ERROR_EXIT_CODE:
        _say(f"config or usage error ({described}): fix it as the worker's message above says; exiting {code}")
    else:
        _say(f"workers failed ({described}) after the restarts allowed; their output is above; exiting {code}")
    return code


def _fatal(record: FatalRecord) -> int:
    _say(
        f"error: {record.message or record.kind} (rank {record.rank}, attempt {record.restart}; no restart can fix "
        f"it, so none was made); exiting {record.exit_code}"
    )
    return record.exit_code


def _describe(exit_code: int) -> str:
    if exit_code < 0:  # torch reports a worker killed by a signal as minus the signal number
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            pass
    return f"exited {exit_code}"


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

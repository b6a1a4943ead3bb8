"""``elastictrain-run``: torchrun, with exit codes a supervisor can act on and no traceback.

Run it exactly as torchrun (same flags, same script or ``-m module`` and arguments). It runs
torch's own launcher (``torch.distributed.run``) in this process, and only changes how it ends:

- the agent was signalled (SIGTERM, SIGINT, SIGUSR1, ... in ``--signals-to-handle``): it has
  forwarded the signal and waited ``--shutdown-timeout`` for the workers' preemption snapshot.
  Exit **143**, the code elastictrain's workers exit with after a preemption, whatever the signal.
  torchrun itself exits 1 with torch's ``SignalException`` traceback, which supervisors read as a
  crash.
- a worker exited 2, elastictrain's code for a config error: exit **2**. Retrying will not help.
- any other worker failure: exit 1 with one line naming the ranks and their exit codes (each
  worker's own output, traceback included, is above it), instead of the ``ChildFailedError`` block.
- the rendezvous store cannot be reached (``RendezvousConnectionError``: with c10d, the agent that
  hosted it, pod 0 or the first node, is gone): exit **200** with one line. A code of 128 or more
  is what Kubeflow's ``restartPolicy: ExitCode`` retries, and 200 is no signal's 128+N, so it is
  never read as a kill. The relaunched job resumes from the newest snapshot.
- success: exit 0.

Anything else the launcher raises (a bad flag, a rendezvous that times out) is torch's and keeps
torch's behaviour.
"""

from __future__ import annotations

import signal
import sys

PREEMPTED_EXIT_CODE = 143  # elastictrain.signals.PREEMPTED_EXIT_CODE, without importing the worker side
CONFIG_ERROR_EXIT_CODE = 2  # elastictrain.errors.ConfigError.exit_code
FAILED_EXIT_CODE = 1
RENDEZVOUS_LOST_EXIT_CODE = 200
PROG = "elastictrain-run"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    args = torchrun.parse_args(argv)
    try:
        torchrun.run(args)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _say(f"{name} forwarded to the workers; exiting {PREEMPTED_EXIT_CODE} (the next launch of the same command "
             "resumes from the newest snapshot)")
        return PREEMPTED_EXIT_CODE
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in sorted(exc.failures.items())}
        return _failed(codes)
    except RendezvousConnectionError:
        return _rendezvous_lost(args)
    return 0


def _rendezvous_lost(args) -> int:
    _say(f"lost the rendezvous store at {args.rdzv_endpoint} ({args.rdzv_backend}): the agent that hosted it "
         f"is gone or unreachable; exiting {RENDEZVOUS_LOST_EXIT_CODE} (retryable: relaunch every node, the job "
         "resumes from the newest snapshot)")
    return RENDEZVOUS_LOST_EXIT_CODE


def exit_code_for(worker_exit_codes: dict[int, int]) -> int:
    """The launcher's exit code when workers failed: 2 if any had a config error, else 1."""
    return CONFIG_ERROR_EXIT_CODE if CONFIG_ERROR_EXIT_CODE in worker_exit_codes.values() else FAILED_EXIT_CODE


def _failed(worker_exit_codes: dict[int, int]) -> int:
    code = exit_code_for(worker_exit_codes)
    described = ", ".join(f"rank {rank} {_describe(exit_code)}" for rank, exit_code in worker_exit_codes.items())
    if code == CONFIG_ERROR_EXIT_CODE:
        _say(f"config error ({described}): fix the config as the worker's message above says; exiting {code}")
    else:
        _say(f"workers failed ({described}) after the restarts allowed; their output is above; exiting {code}")
    return code


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

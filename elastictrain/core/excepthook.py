"""Uncaught user errors print as one line.

Importing this module installs a ``sys.excepthook`` that prints ``elastictrain: error: <message>``
for an :class:`~elastictrain.core.errors.ElastictrainError` and exits with the error's code, so a
ConfigError from ``Trainer(..., overrides=sys.argv[1:])`` in a user's script reads like the command
line's. Under torchrun the line is said once per node (fatal.py); an error its session logged
(failures.py) is not printed again. Every other exception goes to the
hook that was there before, traceback and all, unless the session that saw it logged its traceback
already (then it exits 1 without a second copy). ``ELASTICTRAIN_TRACEBACK=1`` shows the traceback
of user errors too.
"""

from __future__ import annotations

import contextlib
import sys
from types import TracebackType

from elastictrain.core.errors import ElastictrainError, tracebacks_wanted, was_logged
from elastictrain.core.fatal import claim_line

_previous_excepthook = sys.excepthook


def _print_user_error(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _exit_if_said(exc)
    _previous_excepthook(exc_type, exc, tb)


def _exit_if_said(exc: BaseException) -> None:
    """SystemExit for an ElastictrainError (said in one line first, unless its session logged it) or a bug whose
    traceback is logged already."""
    if isinstance(exc, ElastictrainError) and not tracebacks_wanted():
        with contextlib.suppress(OSError, ValueError):  # a closed stdout must not hide the message
            sys.stdout.flush()  # what the script printed comes first, as with a traceback
        say_user_error(exc)
        # CPython exits with this code when an excepthook raises SystemExit, so a script's
        # config error ends with 2, as on the command line.
        raise SystemExit(exc.exit_code)
    if was_logged(exc):  # a bug whose traceback the rank that had it logged: once is enough
        raise SystemExit(1)


def say_user_error(exc: ElastictrainError) -> None:
    """Print ``elastictrain: error: <message>`` on stderr: the one line a user error is, said once per node under
    torchrun (fatal.py), not once per rank and attempt, and not again after its session's log line."""
    if claim_line(exc) and not was_logged(exc):
        print(f"elastictrain: error: {exc}", file=sys.stderr, flush=True)


def keep_excepthook_outermost() -> None:
    """After ``torch.distributed.init_process_group``: it wraps ``sys.excepthook`` to prefix what the hook it wraps
    prints with the rank, into a buffer that is lost when that hook exits, so a user error's line would vanish.
    Ours goes around torch's again; every other exception still reaches torch's (and the prefix)."""
    wrapped = sys.excepthook
    if wrapped is _print_user_error or getattr(wrapped, "_elastictrain_outermost", False):
        return

    def outermost(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _exit_if_said(exc)
        wrapped(exc_type, exc, tb)

    outermost._elastictrain_outermost = True  # type: ignore[attr-defined]
    sys.excepthook = outermost


def install_excepthook() -> None:
    """Print uncaught ElastictrainErrors as one line; every other exception goes to the previous hook."""
    global _previous_excepthook
    if sys.excepthook is not _print_user_error:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _print_user_error


# Installed here, on import: the package's __init__ imports this module, and importing any module of
# the package runs that __init__ first, so every code path that can raise one of these errors has it.
install_excepthook()

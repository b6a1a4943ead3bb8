"""The session's calls in their order: each misuse is one UsageError naming the call and the fix.

SETUP calls (wrap, register, loader, …) before ``restore()``, TRAIN calls (step, epochs, …) after it, and none of
them before the ``with`` block has set the session up or after it has ended (a loop dedented out of the block).
"""

from __future__ import annotations

from collections.abc import Callable

from elastictrain.core.errors import UsageError
from elastictrain.core.states import State, StateMachine
from elastictrain.dist import group as dist
from elastictrain.dist.failures import used_after_the_block


class CallOrder:
    """Check one session's calls against its state: ``context(call)`` returns the process group's context."""

    def __init__(self, machine: StateMachine, ctx: Callable[[], dist.DistContext | None]) -> None:
        self.machine, self._ctx = machine, ctx
        self.left = False  # the with block has ended

    def context(self, call: str = "") -> dist.DistContext:
        if self.left and call:  # rank, world_size, is_main still answer: a summary printed after the block asks them
            raise used_after_the_block(call)
        ctx = self._ctx()
        if ctx is None:
            raise UsageError("the session is not set up: use it as `with elastictrain.Session(config) as session:`")
        return ctx

    def in_setup(self, call: str, why: str = "") -> None:
        self.context(f"session.{call}()")
        if self.machine.state is not State.SETUP:
            raise UsageError(
                f"session.{call}() after session.restore(): {why or 'set the session up before restoring'}"
            )

    def training(self, call: str) -> None:
        self.context(f"session.{call}()")
        if self.machine.state is State.SETUP:
            raise UsageError(
                f"session.{call}() before session.restore(): restore first (a fresh start when there is "
                "no snapshot), so that training continues from the newest snapshot"
            )

    def loader_finished(self) -> bool:
        """For the loader: whether the run is done (and a UsageError when iterated after the block)."""
        self.context("iterating session.loader()'s loader")
        return self.machine.finished

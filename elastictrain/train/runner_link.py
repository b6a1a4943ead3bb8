"""What a step runner sees of the session: ``StepSession``, the public calls it uses, and ``RunnerLink``, the parts of
an optimizer step that only the session holds (``session.runner_link()``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RunnerLink:
    """``session.runner_link()``: for ``StepRunner`` (step_runner.py), or a step runner of your own."""

    grad_sync: Any  # the gradient sync session.wrap(model, loss_fn) built (gradsync.py); None without a loss_fn
    checks_gradients: bool  # anomaly.check_gradients: the gradient norm is read each step even without clipping
    agree_ahead: Callable[[int], None]  # skip: start the ranks' agreement on the step's logged losses (anomalies.py)
    any_rank: Callable[[bool], bool]  # whether a flag is true on any rank: one 1-element all-reduce


class StepSession(Protocol):
    """The part of ``Session``'s public surface a step runner calls."""

    @property
    def config(self) -> Any: ...

    @property
    def global_step(self) -> int: ...

    def runner_link(self) -> RunnerLink: ...

    def autocast(self) -> AbstractContextManager[Any]: ...

    def log(self, samples: int = 1, **values: Any) -> None: ...

    def rank_state_final(self) -> None: ...

    def gradients_ok(self, parameters: Any = None, *, loss: Any = None, norm: float | None = None) -> bool: ...

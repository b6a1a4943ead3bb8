"""What a session hands a step runner: the parts of an optimizer step that only the session holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RunnerLink:
    """``session.runner_link()``: for ``StepRunner`` (step_runner.py), or a step runner of your own."""

    grad_sync: Any  # the gradient sync session.wrap(model, loss_fn) built (gradsync.py); None without a loss_fn
    checks_gradients: bool  # anomaly.check_gradients: the gradient norm is read each step even without clipping
    agree_ahead: Callable[[int], None]  # start the ranks' agreement on the losses logged for that step (anomalies.py)
    any_rank: Callable[[bool], bool]  # whether a flag is true on any rank: one 1-element all-reduce

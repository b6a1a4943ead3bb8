"""One optimizer step of the usual kind: micro-batches, autocast, a grad scaler, clipping, the scheduler.

``StepRunner(session, model, optimizer, ...)`` runs a step's micro-batches through
``model(batch)`` (the module ``session.wrap(model, loss_fn)`` returned: its forward is the loss,
inside DDP's forward), each under the gradient sync's context (DDP's ``no_sync`` for all but the
last, or the per-shard gradients of ``train.virtual_shards``), logs each micro-batch's loss and
metrics to the session, and steps the optimizer unless ``session.gradients_ok`` says not to. It
tells the session when its per-rank state is final, before the last backward, so that survivor
copies name the step this one completes; reading no gradient norm under ``anomaly.policy=skip``,
it starts the ranks' agreement on their losses there too, overlapped with the backward.
``Trainer`` uses it; a custom loop with one optimizer may too. Call ``session.step()`` after ``run``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch

from elastictrain.core import failpoints
from elastictrain.data.sampling import batch_size_of
from elastictrain.health.norms import clipping_norm, grad_norm
from elastictrain.train.runner_link import StepSession
from elastictrain.train.task import split_loss


class StepRunner:
    def __init__(
        self,
        session: StepSession,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
    ) -> None:
        link = session.runner_link()  # the parts of a step only the session holds (runner_link.py)
        if link.grad_sync is None:
            raise TypeError("StepRunner trains the module session.wrap(model, loss_fn) returned; wrap with a loss_fn")
        train = session.config.train
        self.session, self.link, self.model, self.optimizer = session, link, model, optimizer
        self.lr_scheduler, self.scaler = lr_scheduler, grad_scaler
        self.clip_grad_norm = train.clip_grad_norm
        self.reads_no_norm = self.clip_grad_norm is None and not link.checks_gradients
        self.params = list(model.parameters())
        self.per_step_scheduler = train.lr_scheduler_interval == "step"
        self._autocast = session.autocast  # train.autocast_dtype, asked of the session (loop_keys.py)

    def run(self, batches: list[Any]) -> None:
        session, link, optimizer, scaler = self.session, self.link, self.optimizer, self.scaler
        sync = link.grad_sync
        accum, step = len(batches), session.global_step
        for micro, batch in enumerate(batches):
            with sync.micro_batch(micro, accum, step):
                with self._autocast():
                    loss, metrics = split_loss(self.model(batch))  # loss_fn inside DDP's forward: see ddp.LossForward
                session.log(batch_size_of(batch), **{"loss": loss, **metrics})
                if micro == accum - 1:
                    # Per-rank state is now what it will be after this step. The backward's gradient
                    # all-reduce is what lets the peers finish the step, so a rank that dies anywhere from
                    # here on leaves a slot naming the step they reach (survivor.py).
                    session.rank_state_final()
                    if self.reads_no_norm:  # the losses are all logged: skip agrees on them during the backward
                        link.agree_ahead(step + 1)
                scaled = sync.scale(loss, accum)
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
        sync.finish(accum)  # every rank holds the step's gradients
        failpoints.hit("optimizer-step", step + 1)  # tests: a rank killed here, its peers go on
        failpoints.corrupt_gradients(self.params, step + 1)  # tests: a fault on one rank after the all-reduce
        norm = checked = None
        if self.clip_grad_norm is not None or link.checks_gradients:
            if scaler is not None:
                scaler.unscale_(optimizer)
            if self.clip_grad_norm is not None:  # the norm clipping uses, checked as it is (FSDP: the global norm)
                norm = clipping_norm(self.params)
                checked = float(norm)
            else:
                checked = grad_norm(self.params)
        # A scaler's non-finite gradients are its own to handle (it skips the step and lowers the scale), on every
        # rank: where they were finite (a fault on another rank after the all-reduce), it is told so.
        overflow = (
            scaler is not None
            and scaler.is_enabled()
            and checked is not None
            and link.any_rank(not math.isfinite(checked))
        )
        if overflow and checked is not None and math.isfinite(checked):
            backed_off(scaler)
        elif not overflow and not session.gradients_ok(norm=checked):  # skip: agreed; rollback: this rank's own
            optimizer.zero_grad(set_to_none=True)  # the update is not taken: an anomaly, or a listed step
            if scaler is not None:
                scaler.update(scaler.get_scale())  # forget this step's unscale, keep the scale and its growth count
            return
        else:
            if self.clip_grad_norm is not None and norm is not None:  # norm: set whenever clipping is
                torch.nn.utils.clip_grads_with_norm_(self.params, self.clip_grad_norm, norm)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None and self.per_step_scheduler:
            self.lr_scheduler.step()


def backed_off(scaler: Any) -> None:
    """What ``scaler.update()`` does after its own non-finite gradients: the step skipped, the scale lowered by its
    backoff factor, its growth count restarted; for a rank whose gradients were finite when another's were not."""
    scale = scaler.get_scale() * scaler.get_backoff_factor()
    scaler.update(scale)  # also forgets this step's unscale_
    state = scaler.state_dict()
    scaler.load_state_dict({**state, "_growth_tracker": 0})


def autocast(dtype: str, device: torch.device) -> Any:
    """``train.autocast_dtype`` as a context: none, bfloat16 or float16 on the session's device."""
    if dtype == "none":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))

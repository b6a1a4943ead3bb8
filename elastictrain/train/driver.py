"""From one optimizer step to the next: the step's accounting, its boundary's vote, and the states after TRAIN.

``StepDriver.step`` is what ``session.step()`` does once the call is checked: advance the data position and the
counters, beat the watchdog, then at the boundary end the epoch, reduce the metrics every
``train.log_every_steps``, vote, and carry out what ``decide`` (plan.py, pure) says until the next TRAIN, DONE
or PREEMPTED: EVALUATE, a durable or fast snapshot, a ROLLBACK. The session builds one at the end of RESTORE.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from elastictrain.core import failpoints
from elastictrain.core.signals import Preempted
from elastictrain.core.states import State
from elastictrain.data.train_data import wrong_micro_batches
from elastictrain.dist.vote import NOTHING, Requests
from elastictrain.health.norms import clipping_norm, grad_norm
from elastictrain.train.plan import decide, run_finished
from elastictrain.train.restore_phase import Restored
from elastictrain.train.runstate import ROLLBACK_KEEPS
from elastictrain.train.setup_phase import SetupPhase
from elastictrain.train.summary import RunSummary, summarize
from elastictrain.train.train_metrics import evaluation_record

log = logging.getLogger("elastictrain")


class StepDriver:
    """Carries the run from one optimizer step to the next (TRAIN and the states after it), on every rank alike."""

    def __init__(
        self,
        restored: Restored,
        setup: SetupPhase,
        evaluate: Callable[[], dict[str, float]] | None,
        epoch_end: list[Callable[[], None]],
        started: float,
    ) -> None:
        """``setup``: what SETUP brought up (the process group, the run's state and events, metrics, data)."""
        assert setup.metrics is not None  # made with the process group, before RESTORE
        self.ctx, self.state, self.machine, self.events = setup.started, setup.state, setup.machine, setup.events
        self.tiers, self.plan, self.model, self.shard = restored.tiers, restored.plan, restored.model, restored.shard
        self.health, self.anomalies = setup.health, setup.health.anomalies
        self.metrics, self.registry, self.data = setup.metrics, setup.registry, setup.data
        self.train = setup.cfg.train
        self.evaluate, self.epoch_end, self.started = evaluate, epoch_end, started
        self.marks_ahead = False  # a step runner marks survivor copies itself (session.rank_state_final)
        self.step_started = time.perf_counter()
        self.summary: RunSummary | None = None
        self._model_parameters: list[nn.Parameter] | None = None  # gradients_ok's default, listed at its first call

    @property
    def global_step(self) -> int:
        return self.state.progress.global_step

    def step(self, values: dict[str, Any]) -> None:
        """Account one optimizer step with its logged ``values``, then carry out its boundary."""
        data, anomalies = self.data, self.anomalies
        if anomalies.active:
            anomalies.loss(values.get("loss"), self.global_step + 1)
            anomalies.stepped(self.global_step + 1, data.step_samples if data is not None else lambda: None)
        if data is not None:
            taken = data.take()
            if len(taken) != self.shard.grad_accum_steps:
                raise wrong_micro_batches(len(taken), self.shard.grad_accum_steps, self.train.grad_accum_steps)
            if values:
                self.metrics.add(sum(taken), values)
        elif values:
            self.metrics.add(1, values)
        self.metrics.stepped(time.perf_counter() - self.step_started)
        self.state.progress.advance(self.shard.samples_per_step if data is not None else 0)
        self.health.beat(self.global_step)
        self.state.goodput.stepped(self.global_step)
        if not self.marks_ahead:
            self.mark()
        self.boundary(stepped=True)

    def gradients_ok(self, parameters: Any, loss: Any, norm: float | None) -> bool:
        """``session.gradients_ok`` (its docstring says what): the check, and the clipping when the update is taken."""
        step, anomalies = self.global_step + 1, self.anomalies
        clip = self.train.clip_grad_norm if norm is None else None
        if not anomalies.active and clip is None and step not in self.state.anomalies.skipped_steps:
            return True
        if norm is None and (clip is not None or anomalies.check_gradients):
            if parameters is None:  # the registered model's, listed once: walking its modules every step costs more
                if self._model_parameters is None:
                    self._model_parameters = list(self.model.parameters())
                parameters = self._model_parameters
            else:
                parameters = list(parameters.parameters() if isinstance(parameters, nn.Module) else parameters)
            total = clipping_norm(parameters) if clip is not None else None
            norm = float(total) if total is not None else grad_norm(parameters)
        ok = anomalies.gradients_ok(norm, step, loss)
        if ok and clip is not None:
            assert total is not None  # clip is set only where no norm was given: total was computed above
            torch.nn.utils.clip_grads_with_norm_(parameters, clip, total)
        return ok

    def boundary(self, stepped: bool) -> None:
        """After a step (or a stream's end): end the epoch, reduce, vote, and carry out the agreed next state."""
        step = self.global_step
        data = self.data
        epoch_ended = data is not None and (data.epoch_ended or not stepped)
        if data is not None and epoch_ended:
            self.state.progress.end_epoch()
            data.end_epoch()
            for callback in self.epoch_end:
                callback()
        if epoch_ended or step % self.train.log_every_steps == 0:
            self._reduce_train_metrics()
        self.health.announce(step)
        # The vote posted now is read at the next voting boundary: it overlaps the steps between.
        requests = self.health.post(self.tiers, step) | self.anomalies.due(step, self.tiers.local is not None)
        if self.anomalies.verifying(step):  # a replay at its anomalous step: every rank learns whether it recurred
            self.anomalies.weights(self.model.parameters(), step)
            requests |= self.health.settle(self.tiers, step)
            if not requests.anomaly:
                self.anomalies.replayed_clean(step)
        if requests.snapshot_failed:
            self.tiers.durable.raise_write_failure()
        if self.next_state(requests) is not State.TRAIN:
            # Leave TRAIN with nothing in flight and everything every rank asked for; never save non-finite weights.
            self.anomalies.weights(self.model.parameters(), step)
            state = self.next_state(requests | self.health.settle(self.tiers, step))
            # The run's end reduces what is left; a snapshot or a stop between two log steps holds each rank's sums
            # instead, so the history has a record at the log steps alone, as an unbroken run's (trackers show it).
            if self.metrics.pending and state is not State.ROLLBACK and run_finished(self.state.progress, self.plan):
                self._reduce_train_metrics()
            interval, paused = self.metrics.interval, time.monotonic()
            self.run(state)
            if self.metrics.interval is interval:  # an interval a snapshot falls in: its samples/s leave the pause out
                interval.started += time.monotonic() - paused
        self.step_started = time.perf_counter()

    def run(self, state: State) -> None:
        """Carry out states until TRAIN (return), DONE (return) or PREEMPTED (raise Preempted)."""
        while True:
            if state in (State.DONE, State.PREEMPTED):
                self.tiers.flush(state is State.DONE, self.global_step)
            self.machine.transition(state, self.global_step)
            if state is State.TRAIN:
                self.mark()  # this rank's part of a copy of this step, should a peer die before the next one
                self.step_started = time.perf_counter()
                return
            if state is State.DONE:
                return
            if state is State.PREEMPTED:
                raise Preempted(self.health.signals.requested or "signal", self.global_step)
            state = {
                State.EVALUATE: self._evaluate_now,
                State.SNAPSHOT: self._snapshot,
                State.LOCAL_SNAPSHOT: self._local_snapshot,
                State.ROLLBACK: self._rollback,
            }[state]()

    def next_state(self, requests: Requests) -> State:
        if requests.preempt:  # recorded before the preemption snapshot: the next attempt reads this one as no failure
            self.state.run_log.current["preempted"] = 1
        return decide(self.state.progress, self.plan, requests)

    def settled_state(self) -> State:
        """The state every rank agrees on now, with nothing in flight (RESTORE's end, and after each state)."""
        return self.next_state(self.health.settle(self.tiers, self.global_step))

    def _evaluate_now(self) -> State:
        assert self.evaluate is not None  # EVALUATE is planned only with an evaluation set
        record = evaluation_record(self.evaluate())
        progress = self.state.progress
        progress.last_evaluated_step = progress.global_step
        self.state.history.append(step=progress.global_step, epoch=progress.epoch, **record)
        log.info(
            "evaluated at step %d (epoch %d): %s",
            progress.global_step,
            progress.epoch,
            " ".join(f"{k}={v:.4g}" for k, v in record.items()),
        )
        self.events.evaluated(progress.global_step, progress.epoch, record)
        return self.settled_state()

    def _snapshot(self) -> State:
        self.tiers.take_durable(self.meta(), time.monotonic() - self.started)
        return self.settled_state()

    def _local_snapshot(self) -> State:
        self.tiers.take_local(self.meta(), time.monotonic() - self.started)
        # No vote here: the ranks agreed on everything when they left TRAIN, nothing is in flight, and
        # a request raised during the copy is read at the next voting step (a collective saved per copy).
        return self.next_state(NOTHING)

    def _rollback(self) -> State:
        """ROLLBACK: judge what every rank saw, restore the newest snapshot in this process, replay from there."""
        failpoints.hit("rollback", self.global_step)  # tests: a rank killed in the middle of a rollback
        rolled_from, started = self.global_step, time.monotonic()
        verdict = self.anomalies.agree()
        samples = self.anomalies.replayed_samples if verdict.action == "data" else None
        self.metrics.discard()  # the snapshot holds its own step's sums
        restored = self.tiers.roll_back(ROLLBACK_KEEPS)
        if restored is None:
            raise self.anomalies.nothing_to_roll_back_to(verdict)
        self.metrics.begin()
        # The skip list first: the data reopens with it.
        self.anomalies.rolled_back(verdict, samples, restored.step, self.shard.batch_size)
        # The snapshot just restored holds neither what this rollback learned nor the replay it starts: a stop at this
        # step (a preemption) must write the step again, or the next attempt would forget them.
        self.state.progress.last_snapshot_step = -1
        if self.data is not None:
            self.data.reopen()
        self.events.rolled_back(rolled_from, restored.step, time.monotonic() - started)
        return self.settled_state()

    def meta(self) -> dict[str, Any]:
        p = self.state.progress
        return {"epoch": p.epoch, "epoch_offset": p.epoch_offset, "world_size": self.ctx.world_size}

    def _reduce_train_metrics(self) -> None:
        self.metrics.reduce(self.shard.samples_per_step)
        self.mark()  # the sums are now in the history (and a stream's epoch may have ended)

    def mark(self, step: int | None = None) -> None:
        """This rank's part of a survivor copy of ``step`` (default: the step just finished)."""
        self.tiers.mark(step, self.registry)

    def write_survivor_copy(self, rank_label: str) -> None:
        """A peer is lost in TRAIN: this rank's survivor copy of the last step every rank finished."""
        self.tiers.write_survivor_copy(
            self.meta(), rank_label, time.monotonic() - self.started, self.registry, self.marks_ahead
        )

    # -- hooks on the transitions out of the run --------------------------------------------------

    def preempted(self, src: State, dst: State, step: int) -> None:
        self.state.run_log.current["preempted"] = 1
        self.health.preempted(step, self.tiers.last_committed)

    def summarize(self, src: State, dst: State, step: int) -> None:
        self.summary = summarize(
            dst.name,
            self.state,
            self.model,
            self.ctx.world_size,
            self.ctx.env.restart_count,
            time.monotonic() - self.started,
        )
        log.info("%s", self.summary.line())

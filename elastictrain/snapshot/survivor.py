"""Survivor copies: when a worker dies inside a step, a survivor on its node writes the step before it.

Under DDP every rank holds the same model, optimizer and progress, and none of them changes
between the start of a step and its optimizer step: forward and backward only make gradients.
What differs per rank is small: its RNG state, its stream position (streams only) and its
metric values since the last reduce (the copy holds them per rank, as a snapshot does). So each
rank leaves those in a slot of its own in node memory in every step, and again after every metric
reduce (``StepSlots``, about 11 KB and 13 us), with the step and the length of the metric
history they go with. A step is marked before its last backward: from there on nothing per rank
changes within the step (backward and the optimizer step draw no random numbers and read no
data), and that backward's gradient all-reduce is what lets the peers finish the step, so no peer
can be past the step a dead rank's slot names. Each slot keeps its record before too: a survivor
whose all-reduce broke is still at the step before, and finds it there.

When a peer dies, the survivors' collective fails: in the step's gradient all-reduce, or in a
metric reduce or a vote between steps. A survivor whose metric history has the length its step's
records name, on every slot, writes a fast-tier copy of that step from its live model and the
slots (``SurvivorCopies.write``). The restart then redoes only the step that was cut short,
instead of everything since the last timed copy (Gupta et al., "Just-In-Time Checkpointing",
EuroSys '24, do the same from the healthy data-parallel replicas). Marked after the all-reduce
instead, a rank killed between its last gradient sent and its mark left the survivors a step
ahead of its slot: 2 of 17 kills of ``benchmarks/goodput.py``'s job, each re-doing ~100 steps.

A node sees only its own ranks' slots. In a job across nodes, each node's lowest survivor copies the
step with its own node's ranks' state and names the others (``slots.InSlots``); their state stays
in their own nodes' slots, which outlive the processes that wrote them (node memory). The restart
restores that copy where every named rank's slot still holds the copy's step, history length and
round (``slots.choose_partial``): each node's writer reads them and sends them to every rank.
Where one is gone with its node (a lost node), the restore reads the newest complete copy instead.
Such a copy prunes nothing when written and is removed once a restore has seen it.

When no copy is written, and the restart reads the newest timed copy as before:

- the failure came outside training (a snapshot, an evaluation);
- any slot holds no record of the survivor's step, history length and rendezvous round (the dead
  rank died in the middle of a metric reduce), or is missing;
- the model has floating-point buffers (BatchNorm statistics change in the forward pass and
  differ per rank);
- a lower local rank is still alive: it writes the copy (the lowest live one does; liveness is an
  ``flock`` each rank holds on its own file while it runs, released by the kernel when it dies).

It imports nothing of the loop: the loop calls ``mark`` in every step and after every metric
reduce, and ``write`` when a peer is lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from elastictrain.core.progress import History, Progress
from elastictrain.core.rng import capture_rng_compact
from elastictrain.snapshot.local_tier import LocalTier
from elastictrain.snapshot.slots import InSlots, StepSlots, key_of, rank_state_of, slot_dir

log = logging.getLogger("elastictrain")


class SurvivorCopies:
    """Marks each step's per-rank state on every rank; after a peer is lost, writes that step's fast copy."""

    def __init__(
        self,
        fast: LocalTier,
        world_size: int,
        round_id: str,
        progress: Progress,
        history: History,
        rank_state: Callable[[], dict[str, Any] | None],
        local_world_size: int | None = None,
    ) -> None:
        self.fast = fast
        self.progress = progress  # replicated: the step every slot must name
        self.history = history  # replicated: the metric sums in the slots go with this many records
        self.world_size = world_size
        self.round_id = round_id
        self.rank_state = rank_state  # this rank's stream positions and metric sums (None: not readable at every step)
        ctx = fast.ctx
        self.slots = StepSlots(slot_dir(fast.store.root), ctx.rank, ctx.env.local_rank)  # see open
        # This node's ranks: torchrun numbers each node's ranks one after another, local rank 0 first.
        first = ctx.rank - ctx.env.local_rank
        self.node_ranks = range(first, first + (local_world_size or world_size))

    @staticmethod
    def applies(
        fast: LocalTier | None, model: torch.nn.Module, world_size: int, local_world_size: int | None
    ) -> str | None:
        """None when survivor copies can work here, else why not (logged once by the caller)."""
        if fast is None:
            return "there is no fast tier (snapshot.local.url)"
        if world_size < 2:
            return "a single worker has no survivor"
        if fast.sharded is not None:
            return "dist.strategy=fsdp: the dead rank's shards are gone with it; the restart reads the newest copy"
        if local_world_size is None:
            return "the launcher does not say how many ranks share this node (torchrun's LOCAL_WORLD_SIZE)"
        if any(buffer.is_floating_point() for buffer in model.buffers()):
            return "the model has floating-point buffers (BatchNorm statistics change in the forward pass)"
        return None

    def open(self) -> None:
        # After RESTORE: the fast tier's directory is then this run's own (LocalTier.join_run).
        self.slots.directory = slot_dir(self.fast.store.root)
        self.slots.open()

    def close(self) -> None:
        self.slots.close()

    def mark(self, device: torch.device, step: int | None = None) -> None:
        """This rank's part of a copy of ``step`` (default: the current one), before its next collective.

        Written before a step's last backward (``step`` is then the one that step completes: nothing
        per rank changes in between), and after a metric reduce.
        """
        self.slots.write(
            {
                "step": self.progress.global_step if step is None else step,
                "records": len(self.history.records),
                "round": self.round_id,
                "rng": capture_rng_compact(device),
                "rank_state": self.rank_state(),
            }
        )

    def write(self, complete: Callable[[], None], meta: dict[str, Any]) -> int | None:
        """A peer was lost while training: write this step's copy if this rank is the node's lowest survivor and
        every slot agrees with its progress and history; returns the step written.

        ``complete`` records what a snapshot of this step would hold besides the state.
        """
        step, live = self.progress.global_step, (self.progress.global_step, len(self.history.records), self.round_id)
        own = self.slots.read(self.slots.rank, want=live)
        if own is None or key_of(own) != live:
            log.info(
                "no survivor copy: this rank is at step %d with %d metric records, its slot at %s",
                step,
                live[1],
                (own["step"], own["records"]) if own else None,
            )
            return None
        if not self.slots.lowest_alive():
            return None  # a lower local rank survived: it writes
        records = {
            rank: own if rank == self.slots.rank else self.slots.read(rank, want=live) for rank in self.node_ranks
        }
        others = {rank: key_of(r) if r else None for rank, r in records.items()}
        differ = {rank: seen for rank, seen in others.items() if seen != live}
        if differ:
            log.info(
                "no survivor copy of step %d: the slots of rank(s) %s name %s (step, metric records, round) "
                "instead; the restart reads the newest fast copy",
                step,
                ",".join(map(str, differ)),
                ", ".join(str(seen[:2]) if seen else "nothing" for seen in differ.values()),
            )
            return None
        if any(r is None or r["rank_state"] is None for r in records.values()):
            log.info(
                "no survivor copy of step %d: the metric sums on %s are not read at every step; the restart "
                "reads the newest fast copy",
                step,
                self.fast.ctx.device.type,
            )
            return None
        complete()
        found = {rank: record for rank, record in records.items() if record is not None}  # every one, checked above
        # Ranks on other nodes: their state stays in their own nodes' slots, and a restore reads it there (slots.py).
        elsewhere = InSlots(step, tuple(r for r in range(self.world_size) if r not in found), live)
        blank = {"rng": None, **dict.fromkeys(own["rank_state"])}
        rank_states = [rank_state_of(found[r]) if r in found else blank for r in range(self.world_size)]
        meta = {**meta, "survivor": True, **({"in_slots": elsewhere.to_meta()} if elsewhere.ranks else {})}
        # A copy that needs other nodes' slots prunes nothing: if they are gone with their node, the copies before it
        # are what a restart reads.
        report = self.fast.save_survivor(step, rank_states, meta, prune=not elsewhere.ranks)
        if report is None:
            log.info("no survivor copy needed: the fast tier already holds step %d", step)
            return step
        if not report.committed:
            return None  # _commit said why in a warning
        log.warning(
            "survivor copy of step %d written to %s in %.3f s: the restart redoes only the step that was cut short%s",
            step,
            self.fast.url,
            report.duration_s,
            f" (the state of rank(s) {', '.join(map(str, elsewhere.ranks))} stays in their nodes' slots)"
            if elsewhere.ranks
            else "",
        )
        return step

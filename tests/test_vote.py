"""The vote's cadence on two real gloo ranks: both ranks vote at the same boundaries and agree on each request at the same step."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as tdist

from elastictrain.dist.group import DistContext
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.dist.vote import Requests, StepVote

STEPS = 120
RAISED_AT = 70  # rank 1 raises a preemption request from this step on, as a signal would


def _rank(rank: int, port: int, every_s: float, step_s: float, results) -> None:
    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
        vote = StepVote(ctx, every_s)
        voted, agreed_at, cadence = [], None, []
        for step in range(1, STEPS + 1):
            time.sleep(step_s)  # the step
            asked = []
            requests = vote.post(lambda: asked.append(step) or Requests(preempt=rank == 1 and step >= RAISED_AT))
            voted += asked
            cadence.append(vote.steps_between)
            if requests.preempt and agreed_at is None:
                agreed_at = step
        results.put((rank, voted, agreed_at, cadence))
    finally:
        tdist.destroy_process_group()


def run_ranks(every_s: float, step_s: float) -> dict[int, tuple]:
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    context = ranks.context()  # fresh processes, forked from a torch-preloaded server
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=_rank, args=(rank, port, every_s, step_s, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        out = {}
        for _ in workers:
            rank, *rest = results.get(timeout=60)
            out[rank] = tuple(rest)
        for worker in workers:
            worker.join(30)
            assert worker.exitcode == 0
        return out
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()


@pytest.mark.slow
def test_a_vote_spans_several_short_steps_and_every_rank_votes_and_agrees_at_the_same_step():
    # 1 ms steps and at most one vote per 10 ms: rank 0 proposes about 10 steps between votes.
    results = run_ranks(every_s=0.01, step_s=0.001)
    (voted0, agreed0, cadence0), (voted1, agreed1, cadence1) = results[0], results[1]
    assert voted0 == voted1, "both ranks exchange at the same boundaries, or their collectives would pair up wrongly"
    assert cadence0 == cadence1
    assert len(voted0) < STEPS / 3, f"a vote at {len(voted0)} of {STEPS} steps"
    assert max(cadence0) > 2
    # Raised at step 70: posted at the first voting boundary from then on, read at the next.
    first_post = min(step for step in voted0 if step >= RAISED_AT)
    read_at = min(step for step in voted0 if step > first_post)
    assert agreed0 == agreed1 == read_at


@pytest.mark.slow
def test_a_zero_interval_votes_at_every_step():
    results = run_ranks(every_s=0.0, step_s=0.0)
    for voted, agreed, cadence in results.values():
        assert voted == list(range(1, STEPS + 1))
        assert agreed == RAISED_AT + 1 and set(cadence) == {1}


def _skewed_rank(rank: int, port: int, results) -> None:
    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
        vote = StepVote(ctx, 0.0)
        try:
            for step in range(1, 6):
                # Rank 1 called session.step() once more than rank 0 before step 3's vote (a step on one rank only).
                vote.post(Requests, step + (rank == 1 and step >= 3))
            vote.settle(Requests(), 5 + rank)
            results.put((rank, "no error"))
        except Exception as exc:  # noqa: BLE001 - the test reports what was raised
            results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        tdist.destroy_process_group()


def test_ranks_voting_from_different_steps_stop_with_one_line_on_every_rank():
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    context = ranks.context()
    results, port = context.Queue(), free_port()
    workers = [context.Process(target=_skewed_rank, args=(rank, port, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    try:
        said = dict(results.get(timeout=60) for _ in workers)
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()
                worker.join()
    for rank in (0, 1):
        assert said[rank].startswith("UsageError: the ranks voted from different steps (mean 3.5): session.step() must "
                                     "be called on every rank"), said

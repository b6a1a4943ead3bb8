"""The round handshake (elastictrain/dist/rounds.py) in one process: a real TCPStore, one thread per rank."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastictrain.core.errors import DistributedSetupError
from elastictrain.dist.rounds import agree_on_round
from tests.helpers.agents import free_port


@pytest.fixture
def store():
    """The launcher's store (a TCPStore server, as torchrun's agent hosts it), seen under the run's prefix."""
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    yield dist.PrefixStore("elastictrain/run-1/", server)


def client(store):
    """A worker's own connection to the same store, under the same prefix."""
    server = store.underlying_store
    return dist.PrefixStore("elastictrain/run-1/", dist.TCPStore("127.0.0.1", server.port, is_master=False))


def start_ranks(store, ranks, world_size, timeout_s=10.0):
    """Each rank in a thread with its own store connection; join() returns {rank: nonce or its exception}."""
    results = {}

    def one(rank, connection):
        try:
            results[rank] = agree_on_round(connection, rank, world_size, timeout_s, poll_interval_s=0.002)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=one, args=(rank, client(store))) for rank in ranks]
    for thread in threads:
        thread.start()

    def join():
        for thread in threads:
            thread.join(timeout=timeout_s + 5)
        assert not any(t.is_alive() for t in threads), "a rank is still waiting"
        return results

    return join


def run_ranks(store, ranks, world_size, timeout_s=10.0):
    return start_ranks(store, ranks, world_size, timeout_s)()


def test_every_rank_of_a_round_gets_the_same_fresh_nonce_and_the_handshake_leaves_no_keys(store):
    nonces = run_ranks(store, range(4), world_size=4)
    assert len(set(nonces.values())) == 1 and isinstance(nonces[0], str) and len(nonces[0]) == 16
    nonce = nonces[0]
    leftovers = [f"round/req/{r}" for r in range(1, 4)] + [f"round/ack/{nonce}/{r}" for r in range(1, 4)]
    assert not any(store.check([key]) for key in leftovers)
    # The next round on the same store agrees on another nonce: it never reuses this round's keys.
    again = run_ranks(store, range(4), world_size=4)
    assert len(set(again.values())) == 1 and again[0] != nonce


def test_a_stale_token_from_a_dead_worker_is_answered_and_the_live_rank_still_joins_the_round(store):
    """A worker of an earlier round died after writing its token; rank 0 of the new round answers
    it (no reader), then the live rank 2 overwrites req/2 and gets the round's nonce."""
    store.set("round/req/2", "token-of-a-dead-worker")
    join_leader = start_ranks(store, [0], world_size=3)
    deadline = time.monotonic() + 10
    while not store.check(["round/resp/token-of-a-dead-worker"]) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert store.check(["round/resp/token-of-a-dead-worker"]), "rank 0 never answered the stale token"
    followers = run_ranks(store, [1, 2], world_size=3)
    nonce = join_leader()[0]
    assert followers == {1: nonce, 2: nonce}
    assert store.get("round/resp/token-of-a-dead-worker").decode() == nonce


def test_ranks_that_start_before_rank_0_wait_for_it(store):
    join_followers = start_ranks(store, [3, 2, 1], world_size=4)
    time.sleep(0.3)  # they have written their tokens and wait
    nonce = run_ranks(store, [0], world_size=4)[0]
    assert join_followers() == {3: nonce, 2: nonce, 1: nonce}


def test_rank_0_names_the_ranks_that_never_check_in_within_the_timeout(store):
    started = time.monotonic()
    results = run_ranks(store, [0, 1], world_size=4, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert isinstance(results[0], DistributedSetupError)
    assert "rank(s) 2, 3 of 4 did not check in within 0.5s" in str(results[0])
    assert "\n" not in str(results[0])


def test_a_rank_without_a_rank_0_says_so_in_one_line(store):
    results = run_ranks(store, [1], world_size=2, timeout_s=0.5)
    assert isinstance(results[1], DistributedSetupError)
    assert str(results[1]).startswith("rank 1 got no answer from rank 0 within 0.5s")

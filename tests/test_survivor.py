"""Survivor copies (elastictrain/snapshot/survivor.py) piece by piece: the per-step slots, the election of the
writer among a node's live ranks, the checks that refuse a copy, and the copy's content.

The whole path under real torchrun with a real SIGKILL is in tests/test_resume.py
(``test_a_worker_killed_inside_a_step_is_restored_from_a_survivor_copy_...``)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from elastictrain.core.config_load import load_config
from elastictrain.dist.group import DistContext
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.dist.reduce import WeightedSums
from elastictrain.core import rng as rng_module
from elastictrain.core.rng import capture_rng, capture_rng_compact, restore_rng, rng_from_compact
from elastictrain.core.progress import History, Progress
from elastictrain.snapshot.format import load_object
from elastictrain.snapshot.local_tier import LocalTier
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.snapshot.slots import SLOT_DIR, InSlots, StepSlots, choose_partial, node_keys, states_in
from elastictrain.snapshot.survivor import SurvivorCopies

CPU = torch.device("cpu")


def test_a_slot_reads_back_its_newest_record_and_a_torn_write_leaves_the_one_before(tmp_path):
    slots = StepSlots(str(tmp_path), rank=0, local_rank=0)
    slots.open()
    try:
        assert slots.read(0) is None
        slots.write({"step": 1})
        slots.write({"step": 2})
        assert slots.read(0) == {"step": 2}
        # A kill in the middle of writing step 3 tears its file: step 2, in the other file, is read.
        slots.write({"step": 3, "pad": "x" * 1000})
        newest = next(p for p in tmp_path.glob("rank-0.*") if b"pad" in p.read_bytes())
        newest.write_bytes(newest.read_bytes()[:-10])
        assert slots.read(0) == {"step": 2}
        assert slots.read(1) is None  # a rank that never wrote
        # A record of the full length whose bytes changed fails its checksum: the one before is read.
        slots.write({"step": 4, "pad": "y" * 1000})
        slots.write({"step": 5, "pad": "z" * 1000})
        newest = next(p for p in tmp_path.glob("rank-0.*") if b"zzz" in p.read_bytes())
        newest.write_bytes(newest.read_bytes().replace(b"zzz", b"zzy", 1))
        assert slots.read(0) == {"step": 4, "pad": "y" * 1000}
    finally:
        slots.close()


@pytest.mark.slow
def test_the_lowest_live_local_rank_writes_and_a_killed_one_gives_way(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from elastictrain.snapshot.slots import StepSlots
        slots = StepSlots({str(tmp_path)!r}, rank=0, local_rank=0)
        slots.open()
        print("open", flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        mine = StepSlots(str(tmp_path), rank=1, local_rank=1)
        mine.open()
        assert not mine.lowest_alive(), "local rank 0 runs: it writes the copy"
        assert StepSlots(str(tmp_path), rank=0, local_rank=0).lowest_alive()  # nobody below rank 0
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        assert mine.lowest_alive(), "the kernel released the killed rank's lock"
        mine.close()
    finally:
        if holder.poll() is None:
            holder.kill()  # by pid: this test's own child
        holder.wait(10)


def test_a_ranks_sums_read_each_value_once_and_round_trip_into_the_same_reduce():
    sums = WeightedSums(CPU)
    sums.add(4, {"loss": torch.tensor(1.0), "acc": 0.123456789})  # a python float is not rounded to float32
    assert sums.state_dict() == {"names": ["acc", "loss"], "values": [0.123456789, 1.0], "samples": [4]}
    sums.add(2, {"loss": torch.tensor(0.1, dtype=torch.float32), "acc": torch.tensor(0.25, dtype=torch.float64)})
    sums._values[0] = "read already"  # read once: the next call reads only what was added since
    state = sums.state_dict()
    assert state["values"] == [0.123456789, 1.0, 0.25, float(torch.tensor(0.1))] and state["samples"] == [4, 2]
    sums._values[0] = 0.123456789
    restored = WeightedSums(CPU)
    restored.load_state_dict(state)
    single = DistContext(LaunchEnv("none"), False, CPU, None, 60.0)
    means, _ = restored.reduce(single)
    assert (means, []) == sums.reduce(single)  # bitwise: the same float64 sums of the same values
    # in float64 throughout: neither the python float nor the float32 loss is rounded to float32 on the way
    assert means["acc"] == pytest.approx((4 * 0.123456789 + 2 * 0.25) / 6, rel=1e-15, abs=0)
    assert means["loss"] == pytest.approx((4 * 1.0 + 2 * float(torch.tensor(0.1))) / 6, rel=1e-15, abs=0)
    assert sums.state_dict() == {"names": ["acc", "loss"], "values": [], "samples": []} and sums.steps == 0
    assert WeightedSums(torch.device("meta")).peek() is None  # off the CPU a read at every step would wait for the device


def test_sums_taken_at_another_world_size_go_to_rank_0_and_every_rank_holds_a_step():
    saved = [{"names": ["loss"], "values": [1.0, 2.0], "samples": [3, 3]}, {"names": ["loss"], "values": [4.0], "samples": [1]}]
    zero, other = WeightedSums(CPU), WeightedSums(CPU)
    zero.load_resharded(saved, 0)
    other.load_resharded(saved, 2)
    assert zero.state_dict() == {"names": ["loss"], "values": [1.0, 2.0, 4.0], "samples": [3, 3, 1]}
    assert other.state_dict() == {"names": ["loss"], "values": [0.0], "samples": [0]} and other.steps == 1
    empty = WeightedSums(CPU)
    empty.load_resharded([{"names": None, "values": [], "samples": []}] * 2, 1)
    assert empty.steps == 0 and empty.names is None


def test_rng_states_survive_the_slot_form_exactly():
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    saved = rng_from_compact(capture_rng_compact(CPU))
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    restore_rng(saved, CPU)
    assert (random.random(), np.random.rand()) == expected[:2] and torch.equal(torch.rand(3), expected[2])


@pytest.mark.parametrize("draws", [0, 1, 2, 5])
def test_numpys_cached_gaussian_survives_the_slot_form_read_from_memory_or_from_get_state(draws, monkeypatch):
    # An odd count of legacy normals leaves one cached (has_gauss=1) with the stream's position unchanged by the
    # next draw: the slot form must hold it, or the restored stream's next normal differs.
    np.random.seed(7)
    np.random.randn(draws)
    memory = capture_rng_compact(CPU)
    assert isinstance(rng_module._NUMPY._located, tuple)  # this numpy's memory was found and proven
    reference = np.random.get_state(legacy=False)
    assert memory["numpy"][1:] == (reference["state"]["pos"], reference["has_gauss"], reference["gauss"])
    assert memory["numpy"][0] == reference["state"]["key"].tobytes()
    monkeypatch.setattr(rng_module._NUMPY, "_located", None)  # numpy's get_state, as where memory cannot be read
    assert capture_rng_compact(CPU)["numpy"] == memory["numpy"]
    expected = np.random.randn(3)
    np.random.seed(0)
    restore_rng(rng_from_compact(memory), CPU)
    assert np.array_equal(np.random.randn(3), expected)


@pytest.mark.parametrize("draws", [0, 1, 2, 700])
def test_pythons_stream_and_cached_gaussian_survive_the_slot_form_read_from_memory_or_from_getstate(draws, monkeypatch):
    # 700 draws pass the twister's 624-word regeneration; an odd count of gauss() leaves gauss_next cached.
    random.seed(11)
    for _ in range(draws):
        random.random()
    random.gauss(0, 1)
    memory = capture_rng_compact(CPU)
    assert isinstance(rng_module._PYTHON._located, int)  # this interpreter's memory was found and proven
    monkeypatch.setattr(rng_module._PYTHON, "_located", None)  # random.getstate, as where memory cannot be read
    assert capture_rng_compact(CPU)["python"] == memory["python"]
    expected = (random.gauss(0, 1), random.random())
    random.seed(0)
    restore_rng(rng_from_compact(memory), CPU)
    assert (random.gauss(0, 1), random.random()) == expected


class Node:
    """Two ranks of one node as SurvivorCopies sees them: rank 0 survives (this object), rank 1's slot is written by hand."""

    def __init__(self, tmp_path, round_id: str = "round-a", local_world_size: int | None = None,
                 overrides: tuple[str, ...] = ()) -> None:
        cfg = load_config(None, [f"snapshot.local.url={tmp_path / 'shm'}", *overrides])
        ctx = DistContext(LaunchEnv("torchrun", rank=0, local_rank=0, world_size=2), True, CPU, "gloo", 60.0,
                          round_id=round_id)
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.progress = Progress()
        self.history = History()
        self.sums = WeightedSums(CPU)
        fast = LocalTier(cfg, ctx, self.model, {"progress": self.progress, "history": self.history},
                         rank_statefuls={"train_sums": self.sums})
        self.store = SnapshotStore(fast.url)
        self.fast = fast
        self.copies = SurvivorCopies(fast, 2, round_id, self.progress, self.history, fast.rank_state_now,
                                     local_world_size)
        self.copies.open()
        self.peer = StepSlots(self.copies.slots.directory, rank=1, local_rank=1)
        self.peer.open()
        self.completed: list[dict] = []

    def at(self, step: int, records: int = 0) -> None:
        """This rank's progress and history: ``step`` steps done, ``records`` metric records."""
        self.progress.global_step = step
        self.history.records = [{"step": i} for i in range(records)]

    def peer_marks(self, step: int, records: int = 0, round_id: str = "round-a", readable: bool = True,
                   seed: int = 1234) -> None:
        torch.manual_seed(seed)  # the peer's RNG: another stream than this rank's
        sums = {"train_sums": {"names": ["loss"], "values": [3.0, 5.0], "samples": [2, 4]}}
        self.peer.write({"step": step, "records": records, "round": round_id, "rng": capture_rng_compact(CPU),
                         "rank_state": sums if readable else None})

    def write(self):
        return self.copies.write(lambda: self.completed.append(True), {"epoch": 0, "epoch_offset": 0, "world_size": 2})

    def steps(self) -> list[int]:
        return [s.step for s in self.store.list_snapshots() if s.manifest is not None]

    def close(self) -> None:
        self.copies.close()
        self.peer.close()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def test_the_copy_holds_the_survivors_model_and_every_ranks_rng_and_metric_sums(node):
    node.sums.add(2, {"loss": torch.tensor(1.0)})
    node.at(7, records=1)
    node.copies.mark(CPU)
    node.peer_marks(7, records=1)
    peer_rng = rng_from_compact(node.peer.read(1)["rng"])["torch"]
    with torch.no_grad():  # forward and backward of step 8 change no weights; the optimizer step never came
        node.model.weight.grad = torch.ones_like(node.model.weight)

    assert node.write() == 7
    assert node.steps() == [7]
    listing = node.store.latest_valid()
    assert listing[0].meta["survivor"] is True
    state = load_object(listing[1]["state.pt"], "copy")
    assert torch.equal(state["rng"][1]["torch"], peer_rng), "the dead rank's RNG comes from its slot"
    assert torch.equal(load_object(listing[1]["model.pt"], "copy")["weight"], node.model.weight)
    # Each rank's values since the last reduce, as a snapshot holds them: the restart reduces them at the next log step.
    assert state["rank_states"]["train_sums"] == [{"names": ["loss"], "values": [1.0], "samples": [2]},
                                                  {"names": ["loss"], "values": [3.0, 5.0], "samples": [2, 4]}]
    assert node.completed == [True] and len(node.history.records) == 1  # no record of its own at the copy's step


def test_a_survivor_whose_all_reduce_broke_copies_the_step_before_from_each_slots_earlier_record(node):
    # Both ranks marked step 7 before its last backward; the peer died before its gradients reached this rank,
    # so this rank is still at step 6, and every slot's record before the newest names it.
    node.at(6, records=1)
    torch.manual_seed(6)
    node.copies.mark(CPU)
    own_rng_at_6 = torch.get_rng_state()
    node.peer_marks(6, records=1, seed=66)
    peer_rng_at_6 = rng_from_compact(node.peer.read(1)["rng"])["torch"]
    torch.rand(3)  # this rank's forward of step 7 drew numbers
    node.copies.mark(CPU, step=7)
    node.peer_marks(7, records=1, seed=77)

    assert node.write() == 6
    state = load_object(node.store.latest_valid()[1]["state.pt"], "copy")
    assert torch.equal(state["rng"][0]["torch"], own_rng_at_6), "this rank's RNG as it was at step 6, not its live one"
    assert torch.equal(state["rng"][1]["torch"], peer_rng_at_6)
    assert state["progress"]["global_step"] == 6


def test_a_slot_torn_in_its_newest_write_still_gives_the_step_before(node):
    node.at(6)
    node.copies.mark(CPU)
    node.peer_marks(6)
    node.copies.mark(CPU, step=7)
    node.peer_marks(7)
    newest = node.peer._paths(1)[node.peer._sequence % 2]  # the file its last write went to
    with open(newest, "r+b") as f:  # the peer killed in the middle of its step-7 mark
        f.truncate(20)
    assert node.write() == 6


def test_no_copy_when_a_slots_sums_could_not_be_read_at_every_step(node):
    node.at(7)
    node.copies.mark(CPU)
    node.peer_marks(7, readable=False)  # a rank on an accelerator: reading its sums each step would wait for it
    assert node.write() is None and node.steps() == []


@pytest.mark.parametrize("why", ["peer-behind", "peer-before-the-reduce", "peer-other-round", "peer-never-wrote",
                                 "this-rank-past-its-slot"])
def test_no_copy_when_any_slot_names_another_step_history_or_round(node, why):
    node.at(7, records=2)
    node.copies.mark(CPU)
    if why == "peer-behind":
        node.peer_marks(6, records=2)  # it died after its optimizer step 7, before its slot: its RNG may have moved
    elif why == "peer-before-the-reduce":
        node.peer_marks(7, records=1)  # its sums are still in its slot, and already in this rank's history
    elif why == "peer-other-round":
        node.peer_marks(7, records=2, round_id="round-before")  # the slot of an earlier attempt
    elif why == "this-rank-past-its-slot":
        node.peer_marks(7, records=2)
        node.at(7, records=3)  # a reduce moved this rank's sums into its history and the slot was not written again
    assert node.write() is None
    assert node.steps() == [] and node.completed == []


def test_a_step_the_fast_tier_already_holds_is_not_written_again(node):
    node.at(7)
    node.copies.mark(CPU)
    node.peer_marks(7)
    assert node.write() == 7
    first = node.store.latest_valid()[0].created_unix
    assert node.write() == 7
    assert node.store.latest_valid()[0].created_unix == first


def test_survivor_copies_apply_to_ddp_groups_on_any_number_of_nodes_without_float_buffers(tmp_path):
    fast = SimpleNamespace(sharded=None)  # a fast tier under DDP
    assert SurvivorCopies.applies(fast, torch.nn.Linear(2, 2), 2, 2) is None
    assert SurvivorCopies.applies(fast, torch.nn.Linear(2, 2), 4, 2) is None  # two nodes: the others' slots at restore
    assert "fsdp" in SurvivorCopies.applies(SimpleNamespace(sharded=object()), torch.nn.Linear(2, 2), 2, 2)
    assert "no fast tier" in SurvivorCopies.applies(None, torch.nn.Linear(2, 2), 2, 2)
    assert "single worker" in SurvivorCopies.applies(fast, torch.nn.Linear(2, 2), 1, 1)
    assert "LOCAL_WORLD_SIZE" in SurvivorCopies.applies(fast, torch.nn.Linear(2, 2), 2, None)
    assert "floating-point buffers" in SurvivorCopies.applies(fast, torch.nn.BatchNorm1d(2), 2, 2)


# --- a job across nodes: the copy names the ranks whose state stays in their own nodes' slots ---


@pytest.fixture
def two_nodes(tmp_path):
    """Rank 0 alone on its node (local world 1 of 2): rank 1's slot is on the other node, another directory."""
    n = Node(tmp_path, local_world_size=1)  # the fast tier keeps two copies, and writes a third over the oldest
    other = StepSlots(str(tmp_path / "other-node" / SLOT_DIR), rank=1, local_rank=0)
    other.open()
    n.other = other
    yield n
    other.close()
    n.close()


def other_node_marks(node, step: int, records: int = 0, round_id: str = "round-a", seed: int = 99):
    torch.manual_seed(seed)
    sums = {"train_sums": {"names": ["loss"], "values": [7.0], "samples": [3]}}
    node.other.write({"step": step, "records": records, "round": round_id, "rng": capture_rng_compact(CPU),
                      "rank_state": sums})
    return torch.get_rng_state()


def test_a_survivor_across_nodes_copies_its_own_nodes_ranks_names_the_others_and_prunes_nothing(two_nodes):
    node = two_nodes
    assert list(node.copies.node_ranks) == [0]
    every_rank = {"rng": capture_rng(CPU), **node.fast.rank_state_now()}  # timed copies: every rank's state
    for step in (4, 5):
        node.fast.save_survivor(step, [every_rank, every_rank], {"epoch": 0, "epoch_offset": 0, "world_size": 2})
    node.at(7, records=1)
    node.copies.mark(CPU)
    node.peer_marks(3)  # a slot of rank 1 on this node too, of an earlier attempt: not this node's rank now
    assert node.write() == 7  # on one node this copy would need rank 1's slot here; across nodes it names it
    assert node.steps() == [4, 5, 7], "a copy that needs another node's slots prunes (or recycles) nothing"
    complete, partial = node.fast.newest_local()
    assert complete is None and partial.manifest.step == 7  # the copy below is read only if restoring passes it over
    assert node.fast.newest_below(7).manifest.step == 5
    assert partial.manifest.meta["in_slots"] == {"ranks": [1], "key": [7, 1, "round-a"]}
    state = load_object(partial.objects["state.pt"], "copy")
    assert state["rng"][1] is None and state["rank_states"]["train_sums"][1] is None
    assert state["rank_states"]["train_sums"][0] is not None

    node.fast.discard(7)
    assert node.steps() == [4, 5]
    assert node.fast.newest_local()[1] is None


@pytest.mark.parametrize(
    "partials, keys, newer_than, chosen",
    [
        # one node's copy of step 7 names rank 1, whose node still holds its slot at the copy's key
        ([InSlots(7, (1,), (7, 1, "r")), None], [{0: [(7, 1, "r")]}, {1: [(7, 1, "r"), (6, 1, "r")]}], 5, 0),
        # the key must match all three: step, metric records, round
        ([InSlots(7, (1,), (7, 1, "r")), None], [{}, {1: [(7, 0, "r")]}], 5, None),
        ([InSlots(7, (1,), (7, 1, "r")), None], [{}, {1: [(7, 1, "other")]}], 5, None),
        # rank 1's node is gone (a lost node): nothing to complete it with
        ([InSlots(7, (1,), (7, 1, "r"))], [{0: [(7, 1, "r")]}], 5, None),
        # a complete copy as new or newer wins
        ([InSlots(7, (1,), (7, 1, "r")), None], [{}, {1: [(7, 1, "r")]}], 7, None),
        # two ranks named: both needed
        ([InSlots(9, (2, 3), (9, 0, "r"))], [{2: [(9, 0, "r")]}], 5, None),
        ([InSlots(9, (2, 3), (9, 0, "r"))], [{2: [(9, 0, "r")], 3: [(9, 0, "r")]}], 5, 0),
        # the newest usable one
        ([InSlots(7, (1,), (7, 0, "r")), InSlots(8, (0,), (8, 0, "r"))], [{0: [(8, 0, "r")]}, {1: [(7, 0, "r")]}], 5, 1),
        ([None, None], [{}, {}], -1, None),
    ],
)
def test_choose_partial(partials, keys, newer_than, chosen):
    assert choose_partial(partials, keys, newer_than) == chosen


def test_a_nodes_slots_give_the_named_ranks_state_at_the_copys_key_and_nothing_else(two_nodes):
    node = two_nodes
    rng_at_7 = other_node_marks(node, 7, records=1)
    other_node_marks(node, 8, records=1, seed=5)  # the slot's newest record: a step later
    directory = node.other.directory
    assert node_keys(directory) == {1: [(8, 1, "round-a"), (7, 1, "round-a")]}
    states = states_in(directory, InSlots(7, (1,), (7, 1, "round-a")))
    assert list(states) == [1]
    assert torch.equal(states[1]["rng"]["torch"], rng_at_7)
    assert states[1]["train_sums"] == {"names": ["loss"], "values": [7.0], "samples": [3]}
    assert states_in(directory, InSlots(7, (1,), (7, 2, "round-a"))) == {}
    assert node_keys(str(node.other.directory) + "-missing") == {}


def test_a_survivor_copy_is_offered_where_no_complete_copy_below_it_verifies(two_nodes):
    node = two_nodes
    every_rank = {"rng": capture_rng(CPU), **node.fast.rank_state_now()}
    node.fast.save_survivor(5, [every_rank, every_rank], {"epoch": 0, "epoch_offset": 0, "world_size": 2})
    state_file = Path(node.fast.store.root) / "step-000000000005" / "state.pt"
    state_file.write_bytes(state_file.read_bytes()[:-8] + b"corrupt!")  # a flipped tail: the copy no longer verifies
    node.at(7, records=1)
    node.copies.mark(CPU)
    assert node.write() == 7
    complete, partial = node.fast.newest_local()
    assert complete is None and partial.manifest.step == 7
    assert node.fast.newest_below(7) is None

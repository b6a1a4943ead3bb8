"""Exact resume under real torchrun: real gloo workers, real SIGKILLs from outside, bitwise checks.

One uninterrupted run is the reference. Every faulted run must end with the same
params_sha256 and — stitched at the step each attempt restored — the very same samples on each
rank in the same order, with torchrun restarting exactly once per kill.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elastictrain.data.sampling import epoch_order
from elastictrain.snapshot.format import load_object
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals

from tests.conftest import parse_job
from tests.helpers import devices, procs
from tests.helpers.corrupt import flip_middle_byte
from tests.helpers.jobs import ONE_THREAD, TIMEOUT_S, launch_job, start_steps, variant_reference
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun


@pytest.fixture(scope="module")
def reference(reference_run):
    final_state = load_object(
        SnapshotStore(str(reference_run.workdir / "run" / "snapshots")).latest_valid()[1]["model.pt"], "final"
    )
    return reference_run.result, reference_run.traces, final_state


def final_state(workdir) -> dict:
    """The state object of the run's final snapshot (optimizer, scheduler, scaler, history, ...), on the CPU."""
    _, objects = SnapshotStore(str(workdir / "run" / "snapshots")).latest_valid()
    return load_object(objects["state.pt"], "final")


def final_history(workdir) -> list[dict]:
    """The metric history of the run's final snapshot: what the trackers (track.*) write, point by point."""
    return final_state(workdir)["history"]["records"]


def assert_same_samples(tmp_path, result, ref_traces) -> None:
    """Each rank's batches, stitched at the step every attempt restored, are the unbroken run's."""
    for rank in (0, 1):
        stitched = stitch(read_traces(tmp_path / "trace", rank), start_steps(result.output))
        assert stitched == ref_traces[rank], f"rank {rank} saw other samples than the unbroken run"


def test_reference_run_trains_every_sample_once_per_epoch(reference):
    result, traces, _ = reference
    assert result.summary["state"] == "DONE" and result.summary["step"] == "240"
    assert len(traces[0]) == len(traces[1]) == 240
    for epoch in range(5):
        seen = [i for rank in (0, 1) for batch in traces[rank][epoch * 48 : (epoch + 1) * 48] for i in batch]
        assert sorted(seen) == list(range(1536)), f"epoch {epoch} did not see each sample exactly once"
    # A different permutation every epoch.
    assert traces[0][0] != traces[0][48]


@pytest.mark.parametrize("variant", [variant.param() for variant in devices.ALL])
def test_sigkill_worker_before_the_first_snapshot_and_again_mid_epoch_resumes_bitwise(tmp_path, variant, request):
    """One job, two kills of rank 1: in step 7 (no snapshot yet: the restart starts over from step 0), then,
    in the restarted attempt, in step 37 (mid-epoch 0: the restart restores step 25). Each kill costs
    exactly one restart, and the run ends with the unbroken run's parameters and samples.

    The same test on each device variant (tests/helpers/devices.py): on CUDA in fp32, bf16 autocast and fp16
    with a GradScaler, two ranks on one GPU; the model's dropout draws from the CUDA generator, so a CUDA RNG
    state not restored (or restored onto the wrong device) changes the parameters. The restarts are forked
    from the preloaded interpreter (warm restarts): each forked worker initialises CUDA itself."""
    reference = variant_reference(variant, request)
    ref_result, ref_traces = reference.result, reference.traces
    first_kill, second_kill = 7, 37
    job = launch_job(tmp_path, "job", [*variant.overrides, f"task.args.pauses=[[1,{first_kill}],[1,{second_kill}]]"])
    for kill_step in (first_kill, second_kill):  # a pause point fires once per job: the second is in attempt 1
        pid = int(procs.wait_for_file(tmp_path / "trace" / f"paused-rank1-call{kill_step}.pid", TIMEOUT_S, job))
        os.kill(pid, signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]

    result = parse_job(job.output())
    # Snapshots every SNAPSHOT_EVERY = 25 steps: none before step 7, step 25 before step 37.
    assert start_steps(result.output) == [0, 0, 25], "expected one restart per kill, from the last snapshot"
    assert result.summary["restart"] == "2"
    assert result.summary["params_sha256"] == ref_result.summary["params_sha256"]
    assert_same_samples(tmp_path, result, ref_traces)
    # Every component of the final snapshot, the GradScaler's scale and growth tracker included (fp16): a scaler
    # that restarted fresh at step 25 would end with another growth tracker than the unbroken run's.
    final, ref_final = final_state(tmp_path), final_state(reference.workdir)
    assert final.get("grad_scaler") == ref_final.get("grad_scaler")
    assert (final.get("grad_scaler") is not None) == variant.name.endswith("fp16")
    if variant.cuda:
        output = result.output
        assert output.count(devices.DETERMINISM_LINE) == 3, "rank 0 of every attempt names the determinism settings"
        assert output.count("started warm, forked from the preloaded interpreter") == 4, "both restarts warm, both ranks"


def test_sigkill_of_the_fast_tiers_writer_restores_its_timed_copy_from_memory_bitwise(tmp_path, reference):
    """The fast tier (snapshot.local.url) with snapshot.local.every_s=auto: rank 0's timer,
    carried by the vote, takes copies at steps every rank agrees on (no step interval and no durable
    snapshot before the kill). Rank 0, the node's writer, is killed; its copy in memory is restored.
    Every rank reads the node's copy itself; the test corrupts it after rank 0 read it and before rank 1
    does (a failpoint), so rank 1 finds it corrupt and every rank takes the bytes rank 0 verified."""
    ref_result, ref_traces, _ = reference
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    job = launch_job(tmp_path, "job", ["task.args.pause_rank=0", "task.args.pause_at_step=150", "task.args.step_sleep_s=0.01",
                                       "snapshot.durable.every_steps=0", f"snapshot.local.url={tmp_path / 'shm'}",
                                       "snapshot.local.every_s=auto", "snapshot.local.survivor_copies=false"],
                     env={"ELASTICTRAIN_FAILPOINT": f"node-copy-read@1:{failpoints}",
                          "ELASTICTRAIN_FAILPOINT_RANK": "1"})
    pid = int(procs.wait_for_file(tmp_path / "trace" / "paused-rank0.pid", TIMEOUT_S, job))
    os.kill(pid, signal.SIGKILL)
    procs.wait_for_file(failpoints / "failpoint-node-copy-read.pid", TIMEOUT_S, job)  # rank 1 of the restart, paused
    read = re.search(r"r0 a1\] INFO read snapshot (\S+): \d+ bytes",
                     job.wait_for(lambda out: "r0 a1] INFO read snapshot " in out, TIMEOUT_S, "rank 0's read"))
    flip_middle_byte(Path(read.group(1)) / "model.pt")  # the copy rank 0 read and verified: corrupted under rank 1
    (failpoints / "failpoint-node-copy-read.resume").touch()
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]

    result = parse_job(job.output())
    restored = re.findall(r"restored step (\d+) from the node-local tier of node 0", result.output)
    assert len(restored) == 1 and 0 < int(restored[0]) < 150, result.output[-4000:]
    assert re.search(r"r0 a1\] WARNING a rank could not read the node-local copy step-\d+ itself \(snapshot .* is "
                     r"corrupt: object 'model.pt' xxh3_128 mismatch", result.output), result.output[-4000:]
    assert f"r0 a1] INFO restored step {restored[0]} from the node-local tier of node 0 (rank 0), sent to the other " \
        "ranks" in result.output, result.output[-4000:]
    assert start_steps(result.output) == [0, int(restored[0])], "expected exactly one restart, from the last copy"
    assert result.summary["restart"] == "1"
    # Young/Daly's interval from the measured cost: first with no failure, then with the kill counted.
    assert re.search(r"a0\] INFO fast-tier copies every [\d.]+ s from now on \(auto, Young/Daly: \d+ ms a copy, "
                     r"0 failure\(s\)", result.output), result.output[-4000:]
    assert re.search(r"a1\] INFO fast-tier copies every [\d.]+ s from now on \(auto, Young/Daly: \d+ ms a copy, "
                     r"1 failure\(s\)", result.output), result.output[-4000:]
    assert result.summary["params_sha256"] == ref_result.summary["params_sha256"]
    assert_same_samples(tmp_path, result, ref_traces)


def test_a_worker_killed_inside_a_step_is_restored_from_a_survivor_copy_of_the_step_before_bitwise(tmp_path, reference,
                                                                                                  reference_run):
    """No timed fast copies and no durable snapshot: rank 1 dies in the forward pass of step 138, so
    the only copy to restore is the one rank 0, the node's surviving rank, writes of step 137 from its
    live model and both ranks' slots (survivor.py). Exactly that step is redone. The metric history is
    the unbroken run's record for record, bitwise, though the copy falls between two log steps and the
    unbroken run snapshots every 25 steps: each rank's values since step 130 are in the copy."""
    ref_result, ref_traces, _ = reference
    kill_step = 138
    job = launch_job(tmp_path, "job", ["task.args.pause_rank=1", f"task.args.pause_at_step={kill_step}",
                                       "snapshot.durable.every_steps=0", f"snapshot.local.url={tmp_path / 'shm'}"])
    pid = int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job))
    os.kill(pid, signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]

    result = parse_job(job.output())
    assert re.search(rf"WARNING survivor copy of step {kill_step - 1} written to ", result.output), result.output[-4000:]
    assert f"restored step {kill_step - 1} from the node-local tier of node 0 (rank 0) (a survivor copy)" in result.output
    # Rank 1 read the copy from its node itself (restore.node_copy_objects): nothing was sent over the process group.
    assert f"r0 a1] INFO restored step {kill_step - 1} from the node-local tier of node 0 (rank 0) (a survivor " \
        "copy), read by every rank from its node" in result.output, result.output[-4000:]
    assert start_steps(result.output) == [0, kill_step - 1], "expected exactly one restart, from the survivor copy"
    assert result.summary["restart"] == "1"
    assert result.summary["params_sha256"] == ref_result.summary["params_sha256"]
    assert_same_samples(tmp_path, result, ref_traces)
    assert final_history(tmp_path) == final_history(reference_run.workdir)


def test_sigkill_agent_and_workers_then_relaunch_resumes_bitwise(tmp_path, reference):
    """A node dies: the agent and its workers are SIGKILLed together; a new torchrun carries on."""
    ref_result, ref_traces, _ = reference
    job = launch_job(tmp_path, "first", ["task.args.pause_rank=0", "task.args.pause_at_step=90"])
    procs.wait_for_file(tmp_path / "trace" / "paused-rank0.pid", TIMEOUT_S, job)
    job.refresh()
    assert len(job.seen_pids) >= 3, "agent and both workers should have been seen"
    job.kill_all()
    assert job.leftover_pids() == []

    relaunched = launch_job(tmp_path, "second", ["task.args.pause_rank=0", "task.args.pause_at_step=90"])  # the same command
    assert relaunched.wait(TIMEOUT_S) == 0, relaunched.output()[-4000:]
    result = parse_job(relaunched.output())
    assert start_steps(job.output()) == [0]
    assert start_steps(result.output) == [75]
    assert result.summary["params_sha256"] == ref_result.summary["params_sha256"]
    for rank in (0, 1):
        stitched = stitch(read_traces(tmp_path / "trace", rank), [0, 75])
        assert stitched == ref_traces[rank]


def test_validation_metrics_over_uneven_shards_equal_one_process_evaluating_everything(reference):
    result, _, final_weights = reference
    model = spirals.SpiralNet(classes=3, hidden=64, dropout=0.1)
    model.load_state_dict(final_weights)
    model.eval()
    points, labels = spirals.make_spirals(509, classes=3, noise=0.15, seed=1235).tensors  # data_seed + 1
    with torch.no_grad():
        logits = model(points)
    assert float(result.summary["val_loss"]) == pytest.approx(F.cross_entropy(logits, labels).item(), abs=1e-4)
    accuracy = (logits.argmax(1) == labels).double().mean().item()
    assert float(result.summary["val_accuracy"]) == pytest.approx(accuracy, abs=1e-4)


def test_restore_into_one_worker_reshards_the_interrupted_epoch(tmp_path):
    """2 workers die at step 61 (epoch 1); one plain-python worker restores step 50 and carries on.

    Epoch 1 must still see every sample exactly once, in the epoch's global order.
    """
    overrides = ["task.args.pause_rank=0", "task.args.pause_at_step=61", "task.args.lr_factory=true"]
    first = launch_job(tmp_path, "first", overrides)
    procs.wait_for_file(tmp_path / "trace" / "paused-rank0.pid", TIMEOUT_S, first)
    first.kill_all()
    shutil.copytree(tmp_path / "run", tmp_path / "again" / "run")  # to make the same change once more
    single = launch_job(tmp_path, "single", overrides, single_process=True, env=ONE_THREAD)
    # Not bitwise equal to the two workers' run (README, "Elastic training"), but reproducible: the same
    # change at the same step re-seeds and sums the same way, and ends with the same parameters.
    # (its own trace directory and no pause: task.args that change no number; one process each, side by side)
    again = launch_job(tmp_path / "again", "single", ["task.args.lr_factory=true", "snapshot.accept_changes=[task.args]"],
                       single_process=True, env=ONE_THREAD)
    assert single.wait(TIMEOUT_S) == 0, single.output()[-4000:]
    result = parse_job(single.output())
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert parse_job(again.output()).summary["params_sha256"] == result.summary["params_sha256"]
    # An LR schedule built from the run's length gets the same length at one worker as at two: the global
    # batch is kept, so the steps are too (not the 480 that 16 samples a step would make).
    assert "lr factory: total_steps=240" in first.output() and "lr factory: total_steps=240" in result.output
    assert result.restored_steps == [50]
    assert "was taken with world size 2, this run has 1: data position re-sharded from sample 64 of epoch 1" in result.output
    # The global batch of 32 is kept (train.on_world_size_change's default): 2 micro-batches of 16.
    assert "world size 2 -> 1: global batch of 32 samples per step kept" in result.output
    # 50 steps, then (1536 - 64) / 32 = 46 steps to end epoch 1, then 3 epochs of 48: as at 2 workers.
    assert result.summary["world_size"] == "1" and result.summary["step"] == str(50 + 46 + 3 * 48)

    (rank0_two_workers, rank0_single), (rank1_two_workers,) = read_traces(tmp_path / "trace", 0), read_traces(tmp_path / "trace", 1)
    epoch1_order = [
        i for step in range(48, 50) for i in rank0_two_workers[step] + rank1_two_workers[step]
    ] + [i for batch in rank0_single[:92] for i in batch]
    assert epoch1_order == epoch_order(1536, seed=0, epoch=1, shuffle=True)


def test_restore_one_worker_snapshot_into_two_workers(tmp_path):
    """1 -> 2 workers where the rest of the epoch (16 samples) is less than one 2-worker step (32).

    The run's global batch (16) cannot be split over 2 ranks of 16: one line says so, and with
    train.on_world_size_change=keep_rank_batch the global batch becomes 32.
    """
    # One intra-op thread, as torchrun gives each of its workers: the run records its first start's count and
    # every later start computes with it, so two threads here made the two workers below run four on two cores.
    single = launch_job(tmp_path, "single", ["train.max_steps=95", "snapshot.durable.every_steps=5"], single_process=True,
                        env=ONE_THREAD)
    assert single.wait(TIMEOUT_S) == 0, single.output()[-4000:]
    assert parse_job(single.output()).summary["step"] == "95"  # sample 1520 of 1536 in epoch 0

    refused = launch_job(tmp_path, "refused", max_restarts=0)
    assert refused.wait(TIMEOUT_S) != 0
    refusal = ("world size 1 -> 2: the global batch of 16 samples per step cannot be kept "
               "(train.on_world_size_change=keep_global_batch): it is not a multiple of train.batch_size 16 x 2 ranks; "
               "world sizes that can keep it: 1 (set --nnodes and --nproc-per-node to stay among them), or set "
               "train.on_world_size_change=keep_rank_batch")
    assert refused.output().count(refusal) == 1, refused.output()[-4000:]  # one rank's log line, said once

    two = launch_job(tmp_path, "two", ["train.on_world_size_change=keep_rank_batch"])
    assert two.wait(TIMEOUT_S) == 0, two.output()[-4000:]
    result = parse_job(two.output())
    assert result.restored_steps == [95] and result.summary["world_size"] == "2"
    assert "was taken with world size 1, this run has 2: data position re-sharded from sample 1520 of epoch 0" in result.output
    assert result.summary["step"] == str(95 + 4 * 48) and result.summary["epoch"] == "5"
    rank0, rank1 = read_traces(tmp_path / "trace", 0)[-1], read_traces(tmp_path / "trace", 1)[-1]
    first_epoch1_step = rank0[0] + rank1[0]
    assert first_epoch1_step == epoch_order(1536, seed=0, epoch=1, shuffle=True)[:32], "epoch 0's last 16 samples are dropped as an incomplete step"

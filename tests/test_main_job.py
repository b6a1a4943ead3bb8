"""The main job and the two ways to train, run for real: torchrun + gloo, plain python, a user script."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.snapshot.format import load_object
from tests.conftest import REPO_ROOT, job_env, parse_job, python_command, torchrun_command, torchrun_launcher
from tests.helpers import procs
from tests.helpers.jobs import ONE_THREAD

TIMEOUT_S = 180


@pytest.mark.torchrun
def test_main_job_learns_and_snapshots_along_the_way(tmp_path):
    """The README's main job: the embedded defaults, 2 gloo workers under torchrun with c10d rendezvous."""
    job = procs.launch(torchrun_command([f"run.dir={tmp_path / 'run'}"]), log_path=tmp_path / "job.log", cwd=tmp_path)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    result = parse_job(job.output())
    assert result.summary["state"] == "DONE" and result.summary["world_size"] == "2"
    assert result.summary["restart"] == "0", "the main job should not need a restart"
    assert float(result.summary["val_accuracy"]) > 0.9, "3 classes: chance is 0.33"
    assert re.fullmatch(r"[0-9a-f]{64}", result.summary["params_sha256"])
    committed = re.findall(r"snapshot \S+/(step-\d+) committed", result.output)
    assert len(committed) >= 5, committed

    store = SnapshotStore(str(tmp_path / "run" / "snapshots"))
    kept = [s.snapshot_id for s in store.list_snapshots()]
    assert kept == committed[-3:], "keep_last=3: the newest three stay"
    manifest, objects = store.latest_valid()
    history = load_object(objects["state.pt"], "final")["history"]["records"]
    train_losses = [r["train_loss"] for r in history if "train_loss" in r]
    assert train_losses[-1] < 0.5 * train_losses[0], "the loss should fall"


def single_process(tmp_path: Path, extra: list[str]) -> list[str]:
    return python_command([
        "task.factory=tests.helpers.tasks:build", f"task.args.trace_dir={tmp_path / 'trace'}",
        f"run.dir={tmp_path / 'run'}", "train.max_epochs=2", "snapshot.durable.every_steps=20",
        "log.plots=false", *extra,
    ])


@pytest.mark.slow
def test_plain_python_run_killed_and_run_again_ends_bitwise_equal(tmp_path):
    for name in ("ref", "faulted"):
        (tmp_path / name / "trace").mkdir(parents=True)
    # The reference and the first faulted run are single processes with directories of their own: side by side.
    reference = procs.launch(single_process(tmp_path / "ref", []), log_path=tmp_path / "ref.log", env={**job_env(), **ONE_THREAD}, cwd=tmp_path)

    faulted_dir = tmp_path / "faulted"
    # The same command both times, as a user re-runs it; the pause happens once per job.
    command = single_process(faulted_dir, ["task.args.pause_rank=0", "task.args.pause_at_step=33"])
    first = procs.launch(command, log_path=tmp_path / "first.log", env={**job_env(), **ONE_THREAD}, cwd=tmp_path)
    procs.wait_for_file(faulted_dir / "trace" / "paused-rank0.pid", TIMEOUT_S, first)
    first.kill_all()
    assert reference.wait(TIMEOUT_S) == 0, reference.output()[-3000:]
    again = procs.launch(command, log_path=tmp_path / "again.log", env={**job_env(), **ONE_THREAD}, cwd=tmp_path)
    assert again.wait(TIMEOUT_S) == 0, again.output()[-3000:]

    result = parse_job(again.output())
    assert result.restored_steps == [20]
    assert result.summary["params_sha256"] == parse_job(reference.output()).summary["params_sha256"]


@pytest.mark.torchrun
@pytest.mark.parametrize("launcher", ["torchrun", "python"])
def test_user_script_handler_style(tmp_path, launcher):
    # Two micro-batches per step: under torchrun the first runs inside DDP's no_sync(). 256 optimizer steps either
    # way: 4 epochs of two workers, 2 of one (its epochs have twice the steps).
    epochs = 4 if launcher == "torchrun" else 2
    script = [
        str(REPO_ROOT / "launch" / "torchrun" / "train_script.py"), f"run.dir={tmp_path / 'run'}",
        f"train.max_epochs={epochs}", "train.grad_accum_steps=2", "train.batch_size=16",
    ]
    if launcher == "torchrun":
        command = torchrun_launcher() + script
    else:
        command = [sys.executable, *script]
    job = procs.launch(command, log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-3000:]
    result = parse_job(job.output())
    world_size = 2 if launcher == "torchrun" else 1
    assert result.summary["world_size"] == str(world_size)
    assert result.summary["step"] == str(epochs * 4096 // (16 * 2 * world_size)) == "256"
    assert float(result.summary["val_accuracy"]) > 0.8
    # The cosine schedule was built for this world size's step count: it falls all the way
    # to zero at the last step and never climbs back (with T_max fixed it would at one worker).
    _, objects = SnapshotStore(str(tmp_path / "run" / "snapshots")).latest_valid()
    lrs = [record["lr"] for record in load_object(objects["state.pt"], "final")["history"]["records"] if "lr" in record]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 1e-9 and lrs[0] > 2.5e-3


def test_readme_example_is_the_tested_script():
    script = (REPO_ROOT / "launch" / "torchrun" / "train_script.py").read_text()
    readme = (REPO_ROOT / "README.md").read_text()
    assert script.strip() in readme, "README's example must be launch/torchrun/train_script.py verbatim"

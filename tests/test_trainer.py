"""The Trainer in this process (one worker, no process group): restore paths, errors, options.

Everything here is real — real storage (memory:// and local disk), real training — only the
launcher is absent, which is what a user running `python train.py` gets.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from elastictrain import SnapshotError, State, StorageError, Trainer, seed_everything
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals
from tests.conftest import REPO_ROOT, job_env

SMALL = {"train_samples": 512, "val_samples": 128, "hidden": 32}


def config(url: str, **train) -> dict:
    return {
        "snapshot": {"durable": {"url": url, "every_steps": 10}},
        "train": {"max_epochs": 2, "batch_size": 16, "log_every_steps": 5, **train},
        "log": {"progress_bar": False},
    }


def trainer(url: str, task_args: dict = SMALL, **train) -> Trainer:
    seed_everything(0)
    return Trainer.from_task(spirals.build(**task_args), config(url, **train))


def memory_url() -> str:
    return f"memory://elastictrain-tests/{uuid.uuid4().hex}"


@pytest.mark.slow
def test_corrupt_newest_snapshot_falls_back_to_the_previous_and_still_ends_bitwise_equal(capfd):
    url = memory_url()
    reference = trainer(url).fit()
    store = SnapshotStore(url)
    newest = store.list_snapshots()[-1].snapshot_id
    path = f"{store.root}/{newest}/model.pt"
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))

    again = trainer(url).fit()
    err = capfd.readouterr().err
    assert f"skipping snapshot {url}/{newest}" in err and "xxh3_128 mismatch" in err
    previous = store.list_snapshots()[-2].step
    assert f"restored snapshot {url}/step-{previous:012d}" in err
    assert again.params_sha256 == reference.params_sha256


@pytest.mark.slow
def test_a_snapshot_of_another_model_is_refused_and_nothing_is_deleted(capfd):
    url = memory_url()
    trainer(url, max_steps=10).fit()
    before = [s.snapshot_id for s in SnapshotStore(url).list_snapshots()]
    with pytest.raises(SnapshotError, match="was saved from a different model .*shape"):
        trainer(url, task_args={**SMALL, "hidden": 48}).fit()
    assert [s.snapshot_id for s in SnapshotStore(url).list_snapshots()] == before
    assert "stopped in state RESTORE at step 0" in capfd.readouterr().err


# Each piece of advice a refusal may give to start over, and the overrides that follow it.
START_FRESH_ADVICE = {
    "snapshot.resume=false": lambda tmp_path: {"snapshot": {"resume": False}},
    "start fresh with snapshot.durable.url set to an empty location": lambda tmp_path: {"snapshot": {"durable": {"url": memory_url()}}},
    "start fresh with another run.dir": lambda tmp_path: {"run": {"dir": str(tmp_path / "another")}},
}


@pytest.mark.slow
@pytest.mark.parametrize("explicit_url", [True, False], ids=["snapshot.durable.url", "run.dir"])
def test_the_advice_given_for_a_changed_model_works_when_followed(tmp_path, explicit_url):
    base = config(memory_url())
    if not explicit_url:
        base = {**base, "snapshot": {"durable": {"every_steps": 10}}, "run": {"dir": str(tmp_path / "run")}}
    seed_everything(0)
    Trainer.from_task(spirals.build(**SMALL), {**base, "train": {**base["train"], "max_steps": 10}}).fit()
    changed = {**SMALL, "hidden": 48}
    seed_everything(0)
    with pytest.raises(SnapshotError, match="was saved from a different model") as refused:
        Trainer.from_task(spirals.build(**changed), base).fit()
    advice = [text for text in START_FRESH_ADVICE if text in str(refused.value)]
    assert advice, str(refused.value)
    for text in advice:
        followed = {**base, **{key: {**base.get(key, {}), **value}
                               for key, value in START_FRESH_ADVICE[text](tmp_path).items()}}
        seed_everything(0)
        summary = Trainer.from_task(spirals.build(**changed), {**followed, "train": {**base["train"], "max_steps": 5}}).fit()
        assert (summary.state, summary.global_step, summary.attempts) == ("DONE", 5, 1), text


def test_unwritable_store_fails_before_any_step(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run = trainer(str(blocker / "snapshots"))
    with pytest.raises(StorageError, match=str(blocker)):
        run.fit()
    assert run.progress.global_step == 0


@pytest.mark.slow
def test_hooks_fire_on_transitions_of_a_real_fit():
    run = trainer(memory_url())
    seen = []
    run.on(dst=State.SNAPSHOT)(lambda src, dst, step: seen.append(step))
    run.on(src=State.EVALUATE)(lambda src, dst, step: seen.append(f"eval@{step}->{dst.name}"))
    run.fit()
    assert seen == [10, 20, 30, "eval@32->TRAIN", 40, 50, 60, "eval@64->SNAPSHOT", 64]


@pytest.mark.slow
def test_time_based_snapshots_are_checked_at_every_step():
    url = memory_url()
    seed_everything(0)
    run = Trainer.from_task(
        spirals.build(**SMALL),
        {**config(url), "snapshot": {"durable": {"url": url, "every_steps": 0, "every_s": 1e-9, "keep_last": 100, "on_done": False}}},
    )
    run.fit()
    steps = [s.step for s in SnapshotStore(url).list_snapshots()]
    # 2 epochs of 32 steps; the timer rides in the per-step vote, so an interval this short fires at every step.
    assert steps == list(range(1, 65)), "one snapshot after every step"


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch():
    """2 micro-batches of 8 (no dropout) take the same steps on the same samples as one batch of 16."""
    no_dropout = {**SMALL, "dropout": 0.0}
    big = trainer(memory_url(), task_args=no_dropout, batch_size=16)
    big.fit()
    accumulated = trainer(memory_url(), task_args=no_dropout, batch_size=8, grad_accum_steps=2)
    accumulated.fit()
    assert accumulated.progress.global_step == big.progress.global_step == 64
    for a, b in zip(accumulated.task.model.parameters(), big.task.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_progress_bar_on_rank_zero(capfd):
    seed_everything(0)
    Trainer.from_task(spirals.build(**SMALL), {**config(memory_url()), "log": {"progress_bar": True}}).fit()
    err = capfd.readouterr().err
    assert "64/64" in err and "step/s" in err


@pytest.mark.slow
def test_yaml_config_through_the_installed_console_script(tmp_path):
    console = shutil.which("elastictrain", path=str(REPO_ROOT / ".venv" / "bin")) or shutil.which(
        "elastictrain", path=str(__import__("pathlib").Path(sys.executable).parent)
    )
    assert console, "the console script `elastictrain` should be installed next to this python"
    (tmp_path / "trace").mkdir()
    config_file = tmp_path / "job.yaml"
    config_file.write_text(
        "task:\n"
        "  factory: tests.helpers.tasks:build\n"
        f"  args: {{trace_dir: {tmp_path / 'trace'}, train_samples: 256, val_samples: 64}}\n"
        "train: {max_epochs: 1, batch_size: 16}\n"
        f"snapshot: {{durable: {{url: {tmp_path / 'snaps'}, every_steps: 4}}}}\n"
    )
    done = subprocess.run(
        [console, "train", "--config", str(config_file), "train.max_steps=10"],
        capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **job_env()}, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "run summary: state=DONE step=10 epoch=0" in done.stderr
    assert [s.step for s in SnapshotStore(str(tmp_path / "snaps")).list_snapshots()] == [4, 8, 10]


def test_a_fresh_run_refuses_a_store_that_holds_another_runs_snapshots():
    url = memory_url()
    trainer(url, max_steps=10).fit()
    before = [s.snapshot_id for s in SnapshotStore(url).list_snapshots()]
    seed_everything(0)
    fresh = Trainer.from_task(spirals.build(**SMALL), {**config(url), "snapshot": {"durable": {"url": url}, "resume": False}})
    with pytest.raises(SnapshotError, match="snapshot.resume=false but .* already holds snapshots"):
        fresh.fit()
    assert [s.snapshot_id for s in SnapshotStore(url).list_snapshots()] == before


def test_a_store_that_cannot_be_opened_is_one_clear_error():
    with pytest.raises(StorageError, match="cannot be opened"):
        trainer("nosuchproto://bucket/run").fit()


@pytest.mark.slow
def test_s3_without_s3fs_installed_is_one_line_saying_what_to_install():
    # s3fs is in the test install; a process where it cannot be imported is what a user without it has.
    script = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from elastictrain.storage.snapshot_store import SnapshotStore\n"
        "SnapshotStore('s3://bucket/run')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, env=job_env())
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("elastictrain: error: snapshot.durable.url='s3://bucket/run' needs a filesystem package")
    assert lines[0].endswith("pip install 'elastictrain[s3]'")

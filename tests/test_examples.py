"""The three custom loops in examples/ under real torchrun: an unbroken run each, and a run whose
worker is SIGKILLed mid-training (torchrun restarts the group), whose torchrun agent then gets
SIGTERM (preemption: a snapshot of the step every rank stops at, exit 143), and whose relaunch of
the same command finishes: its params_sha256 equals the unbroken run's.

The faulted runs go through tests/helpers/paused_example.py, which runs the example unchanged and
pauses a rank inside a chosen step so that each signal lands there; the unbroken runs are the
examples exactly as a user starts them. examples/first_job.py, docs/tutorial.md's job, is run in this
process instead (no launcher): stopped, started again, and compared with an unbroken run.
"""

from __future__ import annotations

import os
import re
import runpy
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastictrain.snapshot.format import load_object
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.conftest import REPO_ROOT, job_env, parse_job, torchrun_launcher
from tests.helpers import devices, procs
from tests.helpers.jobs import start_steps

TIMEOUT_S = 180
SNAPSHOT_EVERY = 5
# A vote at every step, so that the preemption is read one step after the signal's (the default
# cadence can span many of these millisecond steps); the same in every run compared.
COMMON = ["log.plots=false", "log.progress_bar=false", "preempt.vote_every_s=0", f"snapshot.durable.every_steps={SNAPSHOT_EVERY}"]
PAUSED = REPO_ROOT / "tests" / "helpers" / "paused_example.py"
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


@dataclass(frozen=True)
class Example:
    steps: int  # optimizer steps of the whole run
    kill_step: int  # rank 1 is SIGKILLed inside this step
    preempt_step: int  # rank 0 is inside this step when the agent gets SIGTERM (in the restarted attempt)


EXAMPLES = {
    "tutorial_trainer": Example(steps=4 * 256 // (16 * 2), kill_step=13, preempt_step=22),  # 8 steps an epoch
    "gan": Example(steps=4 * 1024 // (32 * 2), kill_step=13, preempt_step=37),
    "accumulation": Example(steps=4 * 1024 // (16 * 2 * 2), kill_step=13, preempt_step=37),  # 2 micro-batches a step
}


# The killed-then-preempted test on each example on the CPU, and on CUDA for the GAN: a custom loop (Session) with two
# models, two optimizers and noise drawn from the device's generator (tests/helpers/devices.py: both ranks on one GPU).
FAULTED_CASES = [pytest.param(example, devices.CPU, id=example) for example in EXAMPLES] + [
    pytest.param("gan", devices.CUDA_FP32, id="gan-cuda-fp32", marks=pytest.mark.cuda)]


def launch(workdir: Path, name: str, example: str, pauses: str | None = None,
           variant: devices.Variant = devices.CPU) -> procs.Launched:
    script = [str(PAUSED)] if pauses is not None else []
    command = [*torchrun_launcher(), *script, str(REPO_ROOT / "examples" / f"{example}.py"),
               f"run.dir={workdir / 'run'}", *COMMON, *variant.overrides]
    env = {**job_env(), "EXAMPLE_PAUSES": pauses or "", "EXAMPLE_PAUSE_DIR": str(workdir)}
    return procs.launch(command, log_path=workdir / f"{name}.log", env=env, cwd=workdir)


def test_the_port_page_shows_the_tutorial_example_as_it_is():
    """docs/custom-loops-port.md shows the port as a whole-file diff: its new side is examples/tutorial_trainer.py."""
    page = (REPO_ROOT / "docs" / "custom-loops-port.md").read_text()
    diff = page.split("```diff\n", 1)[1].split("\n```", 1)[0].splitlines()
    assert diff[1] == "+++ examples/tutorial_trainer.py" and diff[2].startswith("@@ -1,")
    shown = [line[1:] for line in diff[3:] if not line.startswith("-")]
    assert shown == (REPO_ROOT / "examples" / "tutorial_trainer.py").read_text().splitlines(), (
        "the example changed: rebuild the page's diff with `diff -U 1000 --label 'tutorial (before)' --label "
        "examples/tutorial_trainer.py before.py examples/tutorial_trainer.py`, before.py being the page's old side")


def run_first_job(monkeypatch, *overrides: str):
    """docs/tutorial.md's script, run as it is in this process (no launcher, one rank); its session when it ended."""
    monkeypatch.setattr(sys, "argv", ["first_job.py", *overrides])
    return runpy.run_path(str(REPO_ROOT / "examples" / "first_job.py"), run_name="__main__")["session"]


def test_the_tutorial_s_job_stopped_and_started_again_ends_bitwise_equal_to_an_unbroken_run(tmp_path, monkeypatch):
    """The tutorial kills a worker of examples/first_job.py under torchrun; here, cheaply, the same script stops at step 3
    (train.max_steps) and a second run of it resumes from that snapshot, in one process, to an unbroken run's weights."""
    common = [f"run.dir={tmp_path / 'run'}", "train.max_epochs=1", "train.batch_size=256"]
    unbroken = run_first_job(monkeypatch, *common, f"snapshot.durable.url=memory://first-job/{uuid.uuid4().hex}").summary
    assert unbroken.state == "DONE" and unbroken.global_step == 2048 // 256
    url = f"snapshot.durable.url=memory://first-job/{uuid.uuid4().hex}"
    stopped = run_first_job(monkeypatch, *common, url, "train.max_steps=3").summary
    assert stopped.state == "DONE" and stopped.global_step == 3
    resumed = run_first_job(monkeypatch, *common, url).summary
    assert resumed.attempts == 2 and resumed.global_step == unbroken.global_step
    assert resumed.params_sha256 == unbroken.params_sha256


def worker_lines(output: str) -> str:
    return "\n".join(line for line in output.splitlines() if "[elastictrain r" in line)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """One unbroken run of each example, as a user starts it, run when first asked for."""
    runs = {}

    def run(example: str, variant: devices.Variant = devices.CPU):
        key = (example, variant.name)
        if key not in runs:
            workdir = tmp_path_factory.mktemp(f"unbroken-{example}-{variant.name}")
            job = launch(workdir, "job", example, variant=variant)
            assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
            procs.kill_all_launched()
            runs[key] = (parse_job(job.output()), workdir)
        return runs[key]

    return run


@pytest.mark.torchrun
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_an_unbroken_run_of_each_example_trains_every_step_with_its_state_in_the_snapshots(unbroken, example):
    result, workdir = unbroken(example)
    assert result.summary["state"] == "DONE" and result.summary["step"] == str(EXAMPLES[example].steps)
    assert result.summary["restart"] == "0" and start_steps(result.output) == [0]
    assert "Traceback" not in result.output
    store = SnapshotStore(str(workdir / "run" / "snapshots"))
    listing, files = store.latest_valid()
    assert listing.step == EXAMPLES[example].steps  # snapshot.durable.on_done
    weights = load_object(files["model.pt"], "final model")
    if example == "gan":
        # Both models are registered: the snapshots hold both (and both optimizers), and both trained.
        assert {name.split(".")[0] for name in weights} == {"generator", "discriminator"}
        assert re.search(r"INFO step \d+ epoch \d+ train_d_loss=\S+ train_g_loss=\S+", result.output)
    if example == "accumulation":
        # The custom metric, reduced across ranks: every log line carries it.
        logged = re.findall(r"INFO step (\d+) epoch \d+ train_accuracy=(\S+) train_loss=", result.output)
        assert logged and logged[-1][0] == str(EXAMPLES[example].steps) and float(logged[-1][1]) > 0.5, logged
        # The guide's whole loop: its EMA is in the snapshots, and restore() found nothing left unregistered.
        assert weights["ema.n_averaged"].item() > 0 and "model.0.weight" in weights
        assert "no registered optimizer" not in result.output and "that is not registered" not in result.output
    if example == "tutorial_trainer":
        assert "layer1.1.running_mean" in weights  # BatchNorm's buffers travel too


@pytest.mark.torchrun
@pytest.mark.parametrize("example, variant", FAULTED_CASES)
def test_each_example_killed_then_preempted_then_relaunched_ends_bitwise_equal_to_the_unbroken_run(tmp_path, unbroken, example,
                                                                                                  variant):
    spec = EXAMPLES[example]
    same_command = f"1@{spec.kill_step},0@{spec.preempt_step}"
    job = launch(tmp_path, "first", example, same_command, variant)
    killed = int(procs.wait_for_file(tmp_path / f"paused-rank1-step{spec.kill_step}.pid", TIMEOUT_S, job))
    os.kill(killed, signal.SIGKILL)
    # torchrun restarts the group; it resumes from the newest snapshot and rank 0 pauses in a later step.
    paused = int(procs.wait_for_file(tmp_path / f"paused-rank0-step{spec.preempt_step}.pid", TIMEOUT_S, job))
    os.kill(job.proc.pid, signal.SIGTERM)
    # The agent passes SIGTERM on to its workers; once it has to rank 0, the paused step goes on.
    job.wait_for(lambda out: f"Sending process {paused} closing signal SIGTERM" in out, TIMEOUT_S, "SIGTERM to rank 0")
    (tmp_path / f"paused-rank0-step{spec.preempt_step}.resume").touch()
    job.wait(TIMEOUT_S)
    output = job.output()
    last_snapshot = spec.kill_step // SNAPSHOT_EVERY * SNAPSHOT_EVERY
    assert start_steps(output) == [0, last_snapshot], "one restart, from the newest snapshot before the kill"
    stopped = [int(step) for step in PREEMPTED.findall(output)]
    assert len(stopped) == 1 and spec.preempt_step <= stopped[0] <= spec.preempt_step + 2, output[-4000:]
    assert SnapshotStore(str(tmp_path / "run" / "snapshots")).latest_valid()[0].step == stopped[0]
    assert "Traceback" not in worker_lines(output)

    again = launch(tmp_path, "second", example, same_command, variant)  # the same command: the pauses happened already
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert start_steps(again.output()) == [stopped[0]]
    result = parse_job(again.output())
    assert result.summary["state"] == "DONE" and result.summary["step"] == str(spec.steps)
    assert result.summary["attempts"] == "3", "the first attempt, torchrun's restart, the relaunch"
    assert result.summary["params_sha256"] == unbroken(example, variant)[0].summary["params_sha256"]
    if variant.cuda:
        assert output.count(devices.DETERMINISM_LINE) == 2 and devices.DETERMINISM_LINE in again.output()

"""Exactly-once tracking under real torchrun: examples/accumulation.py (the custom-loop API, with a metric the user
logs) writes to TensorBoard and to a real ``mlflow server`` on 127.0.0.1. An unbroken run (its MLflow server hung for
30 steps of it), and a run whose workers get 3 SIGKILLs at random steps and whose agent then gets a preemption,
relaunched to the end, are read back with the trackers' own readers (TensorBoard's event file loader,
``MlflowClient.get_metric_history``): the same series, every (name, step) once, bitwise; one MLflow run across the 5
attempts; restarts as markers at the steps restored.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import numpy
import pytest

from tests.conftest import REPO_ROOT, WARM, job_env, parse_job, torchrun_launcher
from tests.helpers import procs
from tests.helpers.jobs import start_steps
from elastictrain.core.config import REDACTED
from elastictrain.core.config_load import load_config
from elastictrain.core.events import SnapshotReport, TrainInterval
from elastictrain.train.runstate import RunState
from elastictrain.observe.trackers.background import TrackerThread
from elastictrain.observe.trackers.exactly_once import Tracking
from elastictrain.observe.trackers.tensorboard_backend import TensorBoardBackend
from tests.helpers.mlflow_server import MlflowServer
from tests.helpers.tracked import once_each, series_of, tensorboard_points

pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

TIMEOUT_S = 240
STEPS = 64  # 4 epochs of 16 steps (1024 samples / (16 x 2 ranks x 2 micro-batches))
MARKER = "elastictrain/restart"
# Metrics every 3 steps, snapshots every 5 and a preemption at step 43 or 44: snapshots and the stop fall between two log
# steps, where each rank's metric values since the last log step are saved with them (not reduced into a record).
COMMON = ["log.plots=false", "log.progress_bar=false", "preempt.vote_every_s=0", "snapshot.durable.every_steps=5",
          "train.log_every_steps=3", "track.tensorboard=true"]
PAUSED = REPO_ROOT / "tests" / "helpers" / "paused_example.py"
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def launch(workdir: Path, name: str, server: MlflowServer, pauses: str | None = None, extra: list[str] = (),
           env: dict[str, str] | None = None) -> procs.Launched:
    script = [str(PAUSED)] if pauses is not None else []
    # Warm restarts, with the trackers' libraries preloaded (each worker would import them again: ~3 s of CPU).
    command = [*torchrun_launcher(max_restarts=4), *WARM, "--preload", "mlflow.tracking,torch.utils.tensorboard",
               *script, str(REPO_ROOT / "examples" / "accumulation.py"),
               f"run.dir={workdir / 'run'}", f"track.mlflow_uri={server.uri}", f"track.mlflow_experiment={workdir.name}",
               *COMMON, *extra]
    env = {**job_env(), "EXAMPLE_PAUSES": pauses or "", "EXAMPLE_PAUSE_DIR": str(workdir), **(env or {})}
    return procs.launch(command, log_path=workdir / f"{name}.log", env=env, cwd=workdir)


def text_tags(directory: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [value.tag for name in sorted(os.listdir(directory)) for event in EventFileLoader(str(directory / name)).Load()
            for value in event.summary.value if value.metadata.plugin_data.plugin_name == "text"]


def mlflow_run(server: MlflowServer, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, f"one MLflow run per elastictrain run, found {len(runs)}"
    run = runs[0]
    series = {name: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
              for name in run.data.metrics}
    return run, {name: sorted(points) for name, points in series.items()}


def wait_for_the_mlflow_run(server: MlflowServer, experiment: str, job: procs.Launched) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        found = client.get_experiment_by_name(experiment)
        if found is not None and client.search_runs([found.experiment_id]):
            return
        assert job.proc.poll() is None, job.output()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no MLflow run in experiment {experiment} after {TIMEOUT_S} s:\n{job.output()[-4000:]}")


@dataclass(frozen=True)
class Unbroken:
    workdir: Path
    output: str
    woken_unix: float  # when the MLflow server was woken


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory, mlflow_server) -> Unbroken:
    """One run of one attempt, its MLflow server SIGSTOPped from step 10 until step 40 (the tracker thread's calls in
    flight). Nothing of what trains waits for the trackers, so it is also the reference the killed run must equal: one
    launch checked both ways."""
    workdir = tmp_path_factory.mktemp("unbroken")
    pauses, outage = "0@10,0@40", {"MLFLOW_HTTP_REQUEST_TIMEOUT": "3"}  # a hung request fails after 3 s
    # Rank 0 waits at step 40 until the timeout is seen: no hang for the watchdog.
    job = launch(workdir, "job", mlflow_server, pauses, ["watchdog.hang_timeout_s=120"], outage)
    try:
        procs.wait_for_file(workdir / "paused-rank0-step10.pid", TIMEOUT_S, job)
        # Its MLflow run made first: a server that comes back just before the run's end answers the points at once
        # (the first calls on a fresh server take seconds on a loaded machine, longer than the end waits for them).
        wait_for_the_mlflow_run(mlflow_server, workdir.name, job)
        mlflow_server.hang()
        (workdir / "paused-rank0-step10.resume").touch()
        procs.wait_for_file(workdir / "paused-rank0-step40.pid", TIMEOUT_S, job)  # 30 steps, 6 snapshots, no wait
        job.wait_for(lambda out: "track: mlflow failed" in out, 60, "the warning that names the tracker")
        woken_unix = time.time()
    finally:
        mlflow_server.wake()
    (workdir / "paused-rank0-step40.resume").touch()
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    procs.kill_all_launched()
    return Unbroken(workdir, job.output(), woken_unix)


@pytest.mark.torchrun
def test_an_unbroken_run_writes_every_step_of_every_metric_once_with_the_config_and_summary(unbroken, mlflow_server):
    board = series_of(tensorboard_points(unbroken.workdir / "run" / "tensorboard"))
    assert set(board) == {"train_loss", "train_accuracy", "lr"}  # train_accuracy: the value the example logs
    log_steps = sorted({*range(3, STEPS + 1, 3), *range(16, STEPS + 1, 16)})  # every 3 steps and each epoch's end
    assert all([step for step, _ in points] == log_steps for points in board.values()), board
    assert sorted(text_tags(unbroken.workdir / "run" / "tensorboard")) == ["elastictrain/config/text_summary",
                                                                           "elastictrain/summary/text_summary"]
    run, series = mlflow_run(mlflow_server, unbroken.workdir.name)
    assert set(series) == set(board)
    # MLflow keeps the float64 that TensorBoard rounds to float32; the points of MLflow's outage included.
    for name, points in series.items():
        assert [(step, float(numpy.float32(value))) for step, value in points] == board[name]
    assert run.data.params["train.log_every_steps"] == "3" and run.data.params["track.tensorboard"] == "true"
    assert run.info.status == "FINISHED" and run.data.tags["summary.global_step"] == str(STEPS)


@pytest.mark.torchrun
def test_three_sigkills_and_a_preemption_give_the_unbroken_runs_series_each_step_once(tmp_path, unbroken, mlflow_server):
    # Random ranks and steps, reproducible (seed 30: rank 1 in step 4, rank 0 in 17, rank 1 in 28, preempted in 43):
    # the first kill lands before the first snapshot (step 5), so the restarted attempt starts fresh and finds the
    # MLflow run in torchrun's store; the others resume from the snapshot before them and replay steps.
    rng = random.Random(30)
    kills = [(rng.choice((0, 1)), rng.randint(low, low + span)) for low, span in ((2, 2), (14, 8), (28, 8))]
    preempt_step = rng.randint(40, 46)
    pauses = ",".join(f"{rank}@{step}" for rank, step in kills) + f",0@{preempt_step}"
    job = launch(tmp_path, "first", mlflow_server, pauses)
    for rank, step in kills:
        os.kill(int(procs.wait_for_file(tmp_path / f"paused-rank{rank}-step{step}.pid", TIMEOUT_S, job)), signal.SIGKILL)
    procs.wait_for_file(tmp_path / f"paused-rank0-step{preempt_step}.pid", TIMEOUT_S, job)
    paused = procs.torchrun_worker(job.proc.pid, 0)  # its warm client: the pid torchrun's lines name
    os.kill(job.proc.pid, signal.SIGTERM)
    job.wait_for(lambda out: f"Sending process {paused} closing signal SIGTERM" in out, TIMEOUT_S, "SIGTERM to rank 0")
    (tmp_path / f"paused-rank0-step{preempt_step}.resume").touch()
    job.wait(TIMEOUT_S)
    preempted = [int(step) for step in PREEMPTED.findall(job.output())]
    assert len(preempted) == 1, job.output()[-4000:]
    assert preempted[0] % 3 and preempted[0] % 16, f"the stop at step {preempted[0]} must fall between two log steps"
    again = launch(tmp_path, "second", mlflow_server, pauses)
    assert again.wait(TIMEOUT_S) == 0, again.output()[-4000:]
    assert parse_job(again.output()).summary["step"] == str(STEPS)
    restored = (start_steps(job.output()) + start_steps(again.output()))[1:]
    assert len(restored) == 4 and restored[0] == 0 and all(step > 0 for step in restored[1:]), restored

    board = series_of(tensorboard_points(tmp_path / "run" / "tensorboard"))
    expected_board = series_of(tensorboard_points(unbroken.workdir / "run" / "tensorboard"))
    # A marker at each restart's step, valued with the attempts the run's snapshots know of (the fresh restart's one).
    assert sorted(board.pop(MARKER)) == list(zip(sorted(restored), [1, 2, 3, 4]))
    once_each(board)
    assert board == expected_board  # bitwise: the same float32 at every step
    run, series = mlflow_run(mlflow_server, tmp_path.name)
    _, expected = mlflow_run(mlflow_server, unbroken.workdir.name)
    markers = series.pop(MARKER)
    once_each(series)
    assert series == expected  # bitwise: the same float64 at every step
    assert sorted(markers) == list(zip(sorted(restored), [1, 2, 3, 4]))
    assert sorted(text_tags(tmp_path / "run" / "tensorboard")) == ["elastictrain/config/text_summary",
                                                                   "elastictrain/summary/text_summary"]
    assert run.info.status == "FINISHED" and run.data.tags["summary.attempts"] == "4"


@pytest.mark.torchrun
def test_a_hung_mlflow_server_costs_the_run_no_stall_and_no_restart_and_its_points_follow_once_it_answers(
        unbroken, mlflow_server):
    """The unbroken run's server hung from step 10 until step 40: training went on past 6 snapshots without waiting,
    the one attempt ended, and the points of the outage reached MLflow once it answered, each once (calls that timed
    out and were sent again included; each equal to TensorBoard's: the test above), each with the time it was
    measured."""
    output = unbroken.output
    assert start_steps(output) == [0] and parse_job(output).summary["restart"] == "0", output[-4000:]
    assert "lost a peer" not in output
    outages = len(re.findall(r"track: mlflow failed in .*training goes on", output))
    assert outages >= 1 and len(re.findall(r"track: mlflow answers again after", output)) == outages, output[-4000:]

    run, series = mlflow_run(mlflow_server, unbroken.workdir.name)
    once_each(series)
    assert run.info.status == "FINISHED"
    from mlflow.tracking import MlflowClient

    history = MlflowClient(tracking_uri=mlflow_server.uri).get_metric_history(run.info.run_id, "train_loss")
    assert sorted(metric.step for metric in history) == sorted(step for step, _ in series["train_loss"])
    times = [metric.timestamp for metric in sorted(history, key=lambda metric: metric.step)]
    assert times == sorted(times) and len(set(times)) == len(times), times  # each point its own time, in order
    measured_in_outage = [metric.timestamp / 1000 for metric in history if 10 < metric.step < 40]
    assert measured_in_outage and max(measured_in_outage) < unbroken.woken_unix, "points carry when they were measured"


def attempt(directory: Path, history: list[dict], restored_step: int, restart_count: int) -> tuple[Tracking, RunState]:
    """One attempt's tracker on rank 0, as the session drives it: started, the snapshot's history restored."""
    run = RunState(1)
    run.history.records = [dict(record) for record in history]
    run.run_log.begin(restart_count=restart_count, world_size=2, start_step=restored_step, launcher="torchrun",
                      started_unix=0.0, restored=restored_step > 0)
    tracking = Tracking([TrackerThread("tensorboard", lambda: TensorBoardBackend(str(directory)))], run, {"run": {"name": "x"}})
    tracking.started(SimpleNamespace(store=None))
    tracking.restored(restored_step, 0.0, restored_step > 0)
    return tracking, run


def wall_times(directory: Path, tag: str) -> list[float]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [event.wall_time for name in sorted(os.listdir(directory)) for event in EventFileLoader(str(directory / name)).Load()
            for value in event.summary.value if value.tag == tag]


def train(tracking: Tracking, run: RunState, steps: range, value) -> None:
    for step in steps:
        run.history.append(step=step, epoch=0, train_loss=value(step))
        tracking.trained(TrainInterval(step=step, epoch=0, steps=1, samples=1, elapsed_s=0.0, metrics={}))


def test_points_wait_for_a_committed_snapshot_and_a_restore_from_an_older_one_writes_no_step_twice(tmp_path):
    """The TensorBoard backend on a real event directory, driven as rank 0's events arrive: nothing is written past the
    newest committed snapshot; an attempt restored from an older snapshot (the newest one lost with its node) at
    another world size, whose replayed values differ, writes only the steps never written, never one twice."""
    directory = tmp_path / "tensorboard"
    first, run = attempt(directory, [], 0, 0)
    train(first, run, range(1, 9), lambda step: step / 10)
    first.snapshotted(SnapshotReport(step=4, committed=False, duration_s=0.0, error="store down"))
    committed_unix = time.time()
    first.snapshotted(SnapshotReport(step=5, committed=True, duration_s=0.0, tier="local"))
    first.closed()  # SIGKILLed in step 9: steps 6 to 8 were never in a committed snapshot
    assert [(step, round(value, 6)) for _, step, value in tensorboard_points(directory)] == [
        (step, round(step / 10, 6)) for step in range(1, 6)]
    # Each point with the time it was measured (trained), not the commit's or the write's.
    times = wall_times(directory, "train_loss")
    assert len(times) == 5 and times == sorted(set(times)) and times[-1] < committed_unix, (times, committed_unix)

    again, run = attempt(directory, run.history.records[:3], 3, 1)  # the copy of step 5 is lost: step 3's restores
    train(again, run, range(4, 11), lambda step: step / 100)  # another world size: other values
    again.snapshotted(SnapshotReport(step=10, committed=True, duration_s=0.0))
    again.closed()
    points = tensorboard_points(directory)
    assert [(step, attempt) for tag, step, attempt in points if tag == MARKER] == [(3, 1.0)]
    written = sorted((step, round(value, 6)) for tag, step, value in points if tag == "train_loss")
    assert written == [(step, round(step / 10, 6)) for step in range(1, 6)] + [
        (step, round(step / 100, 6)) for step in range(6, 11)]


def test_a_restart_marker_an_attempt_died_before_writing_is_written_by_the_next_attempt_and_none_twice(tmp_path):
    """Markers are written on the tracker's thread, which a SIGKILL can beat (its import and open take seconds under
    load): the next attempt writes every restart of the run log it restored that the backend does not store yet. Two
    attempts that resumed from the same step (the first killed before its next snapshot) stay two markers."""
    directory = tmp_path / "tensorboard"
    fresh, at_15 = dict(rc=1, step=0, unix=100.0, reason="fresh"), dict(rc=2, step=15, unix=115.0, reason="restart")
    at_25, again_at_25 = dict(rc=3, step=25, unix=125.0, reason="restart"), dict(rc=4, step=25, unix=130.0, reason="restart")

    def resumed(attempts: list[dict]) -> None:
        run = RunState(1)
        for entry in attempts:
            run.run_log.begin(restart_count=entry["rc"], world_size=2, start_step=entry["step"], launcher="torchrun",
                              started_unix=entry["unix"], restored=entry["reason"] != "fresh")
        tracking = Tracking([TrackerThread("tensorboard", lambda: TensorBoardBackend(str(directory)))], run, {})
        tracking.started(SimpleNamespace(store=None))
        tracking.restored(attempts[-1]["step"], 0.0, attempts[-1]["reason"] != "fresh")
        tracking.closed()

    resumed([fresh])  # wrote its marker; the attempt at step 15 was killed before its thread wrote one
    resumed([fresh, at_15, at_25])  # killed before the next snapshot: the next attempt resumes from step 25 too
    resumed([fresh, at_15, again_at_25])
    markers = sorted((step, value) for tag, step, value in tensorboard_points(directory) if tag == MARKER)
    assert markers == [(0, 1.0), (15, 2.0), (25, 3.0), (25, 3.0)]
    assert sorted(wall_times(directory, MARKER)) == [100.0, 115.0, 125.0, 130.0]  # each when its attempt started


def test_a_password_in_the_mlflow_uri_is_redacted_where_the_config_is_logged_or_saved():
    config = load_config(None, ["track.mlflow_uri=https://alice:s3cret@mlflow.example:5000/"])
    assert config.to_dict(redact=True)["track"]["mlflow_uri"] == f"https://{REDACTED}@mlflow.example:5000/"
    assert config.track.mlflow_uri == "https://alice:s3cret@mlflow.example:5000/"  # the client still gets it


def until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.01)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    """The elastictrain logger's lines (it may not propagate to the root logger caplog listens on)."""
    logger, kept = logging.getLogger("elastictrain"), Kept()
    logger.addHandler(kept)
    yield lambda: list(kept.messages)
    logger.removeHandler(kept)


class Outage:
    """A tracker backend whose calls hang while ``down`` is set (a stopped server) and then fail, as a timeout does."""

    name = "flaky"

    def __init__(self) -> None:
        self.down, self.made = threading.Event(), []

    def call(self, what: str) -> None:
        if self.down.is_set():
            raise TimeoutError(f"{what}: read timed out")
        self.made.append(what)


def test_a_tracker_that_stops_answering_costs_the_caller_nothing_and_gets_every_call_once_in_order(warnings_logged):
    backend = Outage()
    tracker = TrackerThread("flaky", lambda: backend, max_pending=5, retry_first_s=0.01, retry_max_s=0.05)
    tracker.submit("a", lambda b: b.call("a"))
    backend.down.set()
    for what in "bcdefgh":  # queued while it is down; the queue holds 5: two are dropped, with one warning
        tracker.submit(what, lambda b, what=what: b.call(what))
    until(lambda: tracker.down_since is not None, 10)
    assert not tracker.close(idle_s=10), "close gives up at once while the tracker does not answer"
    messages = warnings_logged()
    assert sum("track: flaky failed in" in m and "training goes on" in m for m in messages) == 1, messages
    assert sum("track: flaky has 5 calls waiting" in m for m in messages) == 1, messages

    backend = Outage()
    tracker = TrackerThread("flaky", lambda: backend, retry_first_s=0.01, retry_max_s=0.05)
    backend.down.set()
    for what in "abc":
        tracker.submit(what, lambda b, what=what: b.call(what))
    until(lambda: tracker.down_since is not None, 10)
    backend.down.clear()  # it answers again: every call, in order, once
    assert tracker.close(idle_s=10)
    assert backend.made == ["a", "b", "c"]
    assert sum("track: flaky answers again" in m for m in warnings_logged()) == 1

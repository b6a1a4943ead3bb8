"""The Prometheus exporter: scripted events scraped over real HTTP, a real Prometheus server, the dashboard."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from elastictrain.core.config import MetricsConfig
from elastictrain.core.errors import ConfigError
from elastictrain.core.events import RunInfo, SnapshotReport, TrainInterval
from elastictrain.observe.goodput import Goodput
from elastictrain.observe.metrics import PrometheusObserver
from elastictrain.core.states import State

from tests.conftest import REPO_ROOT, job_env, torchrun_command
from tests.helpers import procs
from tests.helpers.prometheus import PROMTOOL, Prometheus, free_port, prometheus_binary

S = State
MONITORING = REPO_ROOT / "launch" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"


def info(world_size: int = 2, node_rank: int = 0, restart_count: int = 0) -> RunInfo:
    return RunInfo(0, 0, world_size, node_rank, restart_count, "torchrun", "/tmp/runs/demo", 96)


def trained(step: int, loss: float) -> TrainInterval:
    return TrainInterval(
        step=step, epoch=step // 48, steps=25, samples=800, elapsed_s=0.5,
        metrics={"train_loss": loss, "train_accuracy": 0.5, "lr": 0.003}, step_time_s_by_rank=[0.02, 0.03],
        sync_wait_s_by_rank=[0.012, 0.001],  # rank 0 waits for rank 1: rank 1 computes 29 ms, rank 0 8 ms
    )


# The events of one attempt, as the loop fires them.
TRAIN_SNAPSHOT_EVALUATE = [
    ("started", info()),
    ("transition", S.SETUP, S.RESTORE, 0),
    ("restored", 0, 0.25, False),
    ("transition", S.RESTORE, S.TRAIN, 0),
    ("trained", trained(25, 0.9)),
    ("transition", S.TRAIN, S.SNAPSHOT, 25),
    ("snapshotted", SnapshotReport(25, True, 0.04, 12345)),
    ("transition", S.SNAPSHOT, S.TRAIN, 25),
    ("trained", trained(50, 0.7)),
    ("transition", S.TRAIN, S.EVALUATE, 50),
    ("evaluated", 50, 1, {"val_loss": 0.8, "val_accuracy": 0.75}),
    ("transition", S.EVALUATE, S.TRAIN, 50),
]
# An anomaly at step 30, rolled back to step 25 and replayed clean (anomalies.py).
ROLLED_BACK = [
    *TRAIN_SNAPSHOT_EVALUATE[:5],
    ("transition", S.TRAIN, S.ROLLBACK, 30),
    ("anomaly", {"step": 30, "value": float("inf"), "decision": "rollback"}),
    ("rolled_back", 30, 25, 1.0),
    ("transition", S.ROLLBACK, S.TRAIN, 25),
    ("trained", trained(35, 0.8)),
    ("anomaly", {"step": 30, "value": float("inf"), "decision": "transient"}),
]
FAILED_SNAPSHOT_THEN_PREEMPTED = [
    ("started", info(world_size=4, node_rank=1, restart_count=2)),
    ("transition", S.SETUP, S.RESTORE, 0),
    ("restored", 40, 1.5, True),
    ("transition", S.RESTORE, S.TRAIN, 40),
    ("trained", trained(50, 0.6)),
    ("transition", S.TRAIN, S.SNAPSHOT, 50),
    ("snapshotted", SnapshotReport(50, False, 0.5, error="disk full")),
    ("transition", S.SNAPSHOT, S.TRAIN, 50),
    ("preempt_requested", "SIGTERM", 55),
    ("transition", S.TRAIN, S.SNAPSHOT, 55),
    ("snapshotted", SnapshotReport(55, True, 0.2, 999)),
    ("transition", S.SNAPSHOT, S.PREEMPTED, 55),
]

RUN = {"run": "demo"}
NODE1 = {"run": "demo", "node": "1"}
CASES = {
    "train-snapshot-evaluate": (TRAIN_SNAPSHOT_EVALUATE, False, [
        ("elastictrain_global_step", RUN, 50),
        ("elastictrain_total_steps", RUN, 96),
        ("elastictrain_epoch", RUN, 1),
        ("elastictrain_samples_per_second", RUN, 1600),
        ("elastictrain_steps_per_second", RUN, 50),
        ("elastictrain_train_metric", {**RUN, "name": "loss"}, 0.7),
        ("elastictrain_train_metric", {**RUN, "name": "accuracy"}, 0.5),
        ("elastictrain_learning_rate", RUN, 0.003),
        ("elastictrain_validation_metric", {**RUN, "name": "loss"}, 0.8),
        ("elastictrain_validation_metric", {**RUN, "name": "accuracy"}, 0.75),
        ("elastictrain_step_time_seconds", {**RUN, "rank": "1"}, 0.03),
        # What the straggler log judges: step time minus the all-reduce wait, against the other ranks' median.
        ("elastictrain_compute_time_seconds", {**RUN, "rank": "0"}, 0.008),
        ("elastictrain_compute_time_seconds", {**RUN, "rank": "1"}, 0.029),
        ("elastictrain_compute_time_others_median_seconds", {**RUN, "rank": "0"}, 0.029),
        ("elastictrain_compute_time_others_median_seconds", {**RUN, "rank": "1"}, 0.008),
        ("elastictrain_state", {**RUN, "state": "train"}, 1),
        ("elastictrain_state", {**RUN, "state": "evaluate"}, 0),
        ("elastictrain_world_size", RUN, 2),
        ("elastictrain_restarts_total", RUN, 0),
        ("elastictrain_restore_duration_seconds", RUN, 0.25),
        ("elastictrain_snapshot_duration_seconds_count", RUN, 1),
        ("elastictrain_snapshot_duration_seconds_sum", RUN, 0.04),
        ("elastictrain_snapshot_duration_seconds_bucket", {**RUN, "le": "0.05"}, 1),
        ("elastictrain_snapshot_duration_seconds_bucket", {**RUN, "le": "0.01"}, 0),
        ("elastictrain_snapshot_size_bytes", RUN, 12345),
        ("elastictrain_last_snapshot_step", RUN, 25),
        ("elastictrain_snapshots_total", RUN, 1),
        ("elastictrain_snapshot_failures_total", RUN, 0),
        ("elastictrain_preemptions_total", RUN, 0),
    ]),
    # Mid-TRAIN only trained() moves the step: the last transition was at step 25.
    "mid-train": (TRAIN_SNAPSHOT_EVALUATE[:9], False, [
        ("elastictrain_global_step", RUN, 50),
        ("elastictrain_train_metric", {**RUN, "name": "loss"}, 0.7),
        ("elastictrain_state", {**RUN, "state": "train"}, 1),
    ]),
    "rolled back, replayed clean": (ROLLED_BACK, False, [
        ("elastictrain_anomalies_total", {**RUN, "decision": "rollback"}, 1),
        ("elastictrain_anomalies_total", {**RUN, "decision": "transient"}, 1),
        ("elastictrain_anomalies_total", {**RUN, "decision": "data"}, 0),
        ("elastictrain_anomalies_total", {**RUN, "decision": "skip"}, 0),
        ("elastictrain_state", {**RUN, "state": "train"}, 1),
        ("elastictrain_global_step", RUN, 35),
    ]),
    "per-node, failed snapshot, preempted": (FAILED_SNAPSHOT_THEN_PREEMPTED, True, [
        ("elastictrain_global_step", NODE1, 55),
        ("elastictrain_world_size", NODE1, 4),
        ("elastictrain_restarts_total", NODE1, 2),
        ("elastictrain_state", {**NODE1, "state": "preempted"}, 1),
        ("elastictrain_state", {**NODE1, "state": "train"}, 0),
        ("elastictrain_snapshot_failures_total", NODE1, 1),
        ("elastictrain_snapshots_total", NODE1, 1),
        ("elastictrain_snapshot_duration_seconds_count", NODE1, 1),  # failures are not timed as commits
        ("elastictrain_last_snapshot_step", NODE1, 55),
        ("elastictrain_preemptions_total", NODE1, 1),
        ("elastictrain_restore_duration_seconds", NODE1, 1.5),
    ]),
}
# Goodput's seconds by cause when every event of a case comes 1 s after the one before (ScriptClock) and the
# process is PROCESS_AGE_S old at its first transition, worked out by hand from elastictrain/observe/goodput.py's rules:
# a state's seconds go to its cause, TRAIN's to productive (no earlier attempt reached these steps), and the
# process's age to restart only in a restarted attempt (restart_count > 0).
PROCESS_AGE_S = 3.0
GOODPUT_SECONDS = {
    # RESTORE t2-t4, TRAIN t4-t6 and t8-t10, SNAPSHOT t6-t8, EVALUATE t10-t12.
    "train-snapshot-evaluate": {"productive": 4, "snapshot": 2, "restore": 2, "recompute": 0, "evaluate": 2, "restart": 0,
                                "rollback": 0},
    # RESTORE t2-t4, TRAIN t4-t6 and t8-t9 (the trained event closes TRAIN's interval), SNAPSHOT t6-t8.
    # RESTORE t2-t4, TRAIN t4-t6 (steps 0-30), ROLLBACK t6-t9, TRAIN t9-t10: steps 26-35, of which 26-30 again.
    "rolled back, replayed clean": {"productive": 2.5, "snapshot": 0, "restore": 2, "recompute": 0.5, "evaluate": 0,
                                    "restart": 0, "rollback": 3},
    "mid-train": {"productive": 3, "snapshot": 2, "restore": 2, "recompute": 0, "evaluate": 0, "restart": 0, "rollback": 0},
    # Restart 2: the process's 3 s; RESTORE t2-t4, TRAIN t4-t6 and t8-t10, SNAPSHOT t6-t8 and t10-t12.
    "per-node, failed snapshot, preempted": {"productive": 4, "snapshot": 4, "restore": 2, "recompute": 0, "evaluate": 0,
                                             "restart": 3, "rollback": 0},
}


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class ScriptClock:
    """A clock for Goodput that moves only when told: 1 s before each event of a script (play)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scripted_goodput() -> tuple[Goodput, ScriptClock]:
    clock = ScriptClock()
    return Goodput(clock=clock, process_age_s=lambda: PROCESS_AGE_S), clock


def play(observers: list, script: list[tuple], clock: ScriptClock | None = None) -> None:
    for event, *args in script:
        if clock is not None:
            clock.now += 1.0
        for observer in observers:
            getattr(observer, event)(*args)


@pytest.fixture
def exporter():
    """A factory of exporters on free ports of 127.0.0.1, each closed after the test."""
    made: list[PrometheusObserver] = []

    def make(per_node: bool = False, goodput: Goodput | None = None) -> PrometheusObserver:
        made.append(PrometheusObserver(MetricsConfig(port=0, host="127.0.0.1", per_node=per_node), goodput=goodput))
        return made[-1]

    yield make
    for observer in made:
        observer.closed()


@pytest.mark.parametrize("case", list(CASES))
def test_scripted_events_are_served_over_http(exporter, case):
    script, per_node, expected = CASES[case]
    goodput, clock = scripted_goodput()
    observer = exporter(per_node=per_node, goodput=goodput)
    play([goodput, observer], script, clock)
    scraped = samples(scrape(observer.port))
    for name, labels, value in expected:
        key = (name, frozenset(labels.items()))
        assert key in scraped, f"{name}{labels} not scraped; have {sorted(n for n, _ in scraped if n == name)}"
        assert scraped[key] == pytest.approx(value), (name, labels)
    # Goodput: one counter per cause, the ratio productive / all, against the seconds worked out by hand.
    labels = dict(NODE1 if per_node else RUN)
    causes = {dict(key)["cause"]: value for (name, key), value in scraped.items() if name == "elastictrain_goodput_seconds_total"}
    assert causes == pytest.approx(GOODPUT_SECONDS[case])
    ratio = scraped[("elastictrain_goodput_ratio", frozenset(labels.items()))]
    assert ratio == pytest.approx(GOODPUT_SECONDS[case]["productive"] / sum(GOODPUT_SECONDS[case].values()))
    # prometheus_client's `_created` series read like counts of their own (`..._seconds_created` a duration): none.
    assert not [name for name, _ in scraped if name.endswith("_created")]
    # A node label everywhere with per_node, nowhere without it.
    assert all(("node", "1") in key for _, key in scraped) == per_node
    assert not any(dict(key).get("node") for _, key in scraped) or per_node


def test_nothing_is_served_but_the_exporter_itself_before_the_run_starts(exporter):
    observer = exporter()
    assert not [name for name, _ in samples(scrape(observer.port))]


def test_at_done_rank_0_stays_for_one_more_scrape_when_it_is_scraped_at_all(exporter):
    """So Prometheus sees the state done and ElastictrainMetricsGone tells a finished run from a lost one."""
    done = [*TRAIN_SNAPSHOT_EVALUATE, ("transition", S.TRAIN, S.DONE, 50)]
    never_scraped = exporter()
    play([never_scraped], done)
    started = time.monotonic()
    never_scraped.closed()  # nothing scrapes it: nothing to wait for
    assert time.monotonic() - started < 5

    observer = exporter()
    play([observer], done[:-1])
    scrape(observer.port)
    play([observer], done[-1:])
    closing = threading.Thread(target=observer.closed)
    closing.start()
    closing.join(timeout=1.0)
    assert closing.is_alive(), "closed() returned before the scrape that shows the run done"
    last = samples(scrape(observer.port))
    closing.join(timeout=10)
    assert not closing.is_alive()
    assert last[("elastictrain_state", frozenset({**RUN, "state": "done"}.items()))] == 1


def test_a_port_in_use_is_one_config_error_line(exporter):
    taken = exporter().port
    with pytest.raises(ConfigError) as raised:
        PrometheusObserver(MetricsConfig(port=taken, host="127.0.0.1"))
    assert str(raised.value) == f"metrics.port={taken} is already in use on 127.0.0.1; pick another port or metrics.port=0"


def test_closed_stops_the_server_and_frees_the_port():
    observer = PrometheusObserver(MetricsConfig(port=0, host="127.0.0.1"))
    port = observer.port
    scrape(port)
    observer.closed()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
    PrometheusObserver(MetricsConfig(port=port, host="127.0.0.1")).closed()  # bindable again


def test_two_exporters_in_one_process_keep_their_own_numbers(exporter):
    first, second = exporter(), exporter()
    play([first], TRAIN_SNAPSHOT_EVALUATE)
    play([second], TRAIN_SNAPSHOT_EVALUATE[:5])
    step = ("elastictrain_global_step", frozenset(RUN.items()))
    assert samples(scrape(first.port))[step] == 50
    assert samples(scrape(second.port))[step] == 25


@pytest.fixture(scope="module")
def prometheus_path():
    path, reason = prometheus_binary()
    if path is None:
        pytest.skip(f"no Prometheus server to test against: {reason}")
    return path


def test_exposition_passes_promtool_lint(exporter, prometheus_path):
    goodput = Goodput()
    observer = exporter(goodput=goodput)
    play([goodput, observer], TRAIN_SNAPSHOT_EVALUATE)
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape(observer.port), capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_scrape_configs_are_valid(prometheus_path):
    static = subprocess.run([PROMTOOL, "check", "config", str(MONITORING / "prometheus-static.yml")], capture_output=True, text=True)
    assert static.returncode == 0, static.stdout + static.stderr
    kubernetes = subprocess.run(
        [PROMTOOL, "check", "config", str(MONITORING / "prometheus-kubernetes.yml")], capture_output=True, text=True
    )
    # Debian builds Prometheus without Kubernetes discovery; elsewhere promtool checks it whole.
    if "field kubernetes_sd_configs not found" not in kubernetes.stdout + kubernetes.stderr:
        assert kubernetes.returncode == 0, kubernetes.stdout + kubernetes.stderr
    # The address rewrite: the pod IP with the annotated port (Prometheus anchors its regexes).
    rules = yaml.safe_load((MONITORING / "prometheus-kubernetes.yml").read_text())["scrape_configs"][0]["relabel_configs"]
    rewrite = next(rule for rule in rules if rule.get("target_label") == "__address__")
    for address in ("10.1.2.3:8080", "10.1.2.3"):
        match = re.fullmatch(rewrite["regex"], f"{address};9400")
        assert match.expand(rewrite["replacement"].replace("$", "\\")) == "10.1.2.3:9400"


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def metric_names_in(expression: str) -> set[str]:
    return set(re.findall(r"\belastictrain_[a-z0-9_]+", expression))


def test_real_prometheus_scrapes_the_exporter_and_runs_every_dashboard_query(exporter, prometheus_path, tmp_path):
    goodput, clock = scripted_goodput()
    observer = exporter(goodput=goodput)
    play([goodput, observer], TRAIN_SNAPSHOT_EVALUATE, clock)
    # The shipped static scrape config, pointed at this exporter.
    config = yaml.safe_load((MONITORING / "prometheus-static.yml").read_text())
    job = config["scrape_configs"][0]
    job["static_configs"][0]["targets"] = [f"127.0.0.1:{observer.port}"]
    job["scrape_interval"] = "1s"
    server = Prometheus(prometheus_path, tmp_path, config["scrape_configs"])
    try:
        server.wait_ready()
        assert server.wait_for_value('elastictrain_global_step{run="demo"}') == 50
        assert server.wait_for_value('elastictrain_world_size{run="demo"}') == 2
        expected_productive_s = GOODPUT_SECONDS["train-snapshot-evaluate"]["productive"]
        assert server.wait_for_value('elastictrain_goodput_seconds_total{cause="productive"}') == expected_productive_s
        for expression in dashboard_expressions():
            server.query(expression.replace("$run", ".*").replace("$__rate_interval", "1m"))  # a syntax error fails here
        # A panel over plain gauges has data right away (rates need two scrapes and are only parsed).
        assert server.query('elastictrain_train_metric{run=~".*",name="loss"}')[0]["value"][1] == "0.7"
    finally:
        server.stop()
    assert server.launched.proc.returncode is not None


def test_dashboard_uses_only_metric_names_the_exporter_serves(exporter):
    goodput = Goodput()
    observer = exporter(goodput=goodput)
    play([goodput, observer], TRAIN_SNAPSHOT_EVALUATE)
    served = {sample_name for sample_name, _ in samples(scrape(observer.port))}
    used = set().union(*map(metric_names_in, dashboard_expressions()))
    assert used, "the dashboard has no elastictrain queries"
    assert used <= served, f"dashboard queries metrics the exporter does not serve: {sorted(used - served)}"
    # Every panel the brief asks for is there.
    for name in ("elastictrain_global_step", "elastictrain_samples_per_second", "elastictrain_train_metric",
                 "elastictrain_validation_metric", "elastictrain_state", "elastictrain_restarts_total",
                 "elastictrain_snapshot_duration_seconds_bucket", "elastictrain_goodput_seconds_total",
                 "elastictrain_step_time_seconds"):
        assert name in used, name


PAUSE_AT_CALL = 35  # rank 0 sleeps in the forward of step 35: steps 1-34 are done
LOG_EVERY = 10


@pytest.mark.torchrun
def test_a_torchrun_job_serves_its_step_mid_run(tmp_path):
    port = free_port()
    (tmp_path / "trace").mkdir()
    overrides = [
        "task.factory=tests.helpers.tasks:build", "train.max_epochs=3", "train.batch_size=16",
        f"train.log_every_steps={LOG_EVERY}", f"run.dir={tmp_path / 'run'}", f"metrics.port={port}", "metrics.host=127.0.0.1",
        "task.args.pause_rank=0", f"task.args.pause_at_step={PAUSE_AT_CALL}", f"task.args.trace_dir={tmp_path / 'trace'}",
    ]
    job = procs.launch(torchrun_command(overrides), log_path=tmp_path / "job.log", env=job_env(), cwd=tmp_path)
    procs.wait_for_file(tmp_path / "trace" / "paused-rank0.pid", 60, job)
    scraped = samples(scrape(port))
    job.kill_all()
    by_name = {name: value for (name, labels), value in scraped.items()}  # one series each, but for state
    # The last log interval before the pause ended at step 30.
    assert by_name["elastictrain_global_step"] == (PAUSE_AT_CALL - 1) // LOG_EVERY * LOG_EVERY
    assert by_name["elastictrain_world_size"] == 2
    assert by_name["elastictrain_restarts_total"] == 0
    states = {dict(labels)["state"]: value for (name, labels), value in scraped.items() if name == "elastictrain_state"}
    assert states["train"] == 1 and sum(states.values()) == 1

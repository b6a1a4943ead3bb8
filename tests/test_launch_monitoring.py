"""launch/monitoring/alerts.yml: valid rules (promtool check), each alert fires and stays silent as its unit tests say.

promtool comes with Debian's prometheus package (installed once if missing, as tests/helpers/prometheus.py does).
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from elastictrain.observe.goodput import Goodput
from tests.helpers.prometheus import PROMTOOL, prometheus_binary
from tests.test_metrics import MONITORING, TRAIN_SNAPSHOT_EVALUATE, exporter, metric_names_in, play, samples, scrape  # noqa: F401

ALERTS = MONITORING / "alerts.yml"
ALERT_TESTS = MONITORING / "alerts.test.yml"
EXPECTED_ALERTS = {"ElastictrainNoProgress", "ElastictrainSnapshotStale", "ElastictrainRestartRate",
                   "ElastictrainSnapshotFailures", "ElastictrainGoodputDrop", "ElastictrainStraggler",
                   "ElastictrainTargetDown", "ElastictrainMetricsGone"}


@pytest.fixture(scope="module")
def promtool():
    path, reason = prometheus_binary()
    if path is None:
        pytest.skip(f"no promtool: {reason}")
    return PROMTOOL


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


@pytest.mark.slow
def test_alert_rules_pass_promtool_check(promtool):
    run = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in run.stdout


@pytest.mark.slow
def test_every_alert_fires_and_stays_silent_as_its_unit_tests_say(promtool):
    run = subprocess.run([promtool, "test", "rules", ALERT_TESTS.name], cwd=MONITORING,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    tested = {case["alertname"] for test in yaml.safe_load(ALERT_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case.get("exp_alerts")}
    assert tested == EXPECTED_ALERTS == {rule["alert"] for rule in alert_rules()}, "each alert has a firing case"


def test_alerts_use_only_metric_names_the_exporter_serves(exporter):  # noqa: F811
    goodput = Goodput()
    observer = exporter(goodput=goodput)
    play([goodput, observer], TRAIN_SNAPSHOT_EVALUATE)
    served = {sample_name for sample_name, _ in samples(scrape(observer.port))}
    used = set().union(*(metric_names_in(rule["expr"]) for rule in alert_rules()))
    assert used <= served, f"alerts query metrics the exporter does not serve: {sorted(used - served)}"

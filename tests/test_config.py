"""The typed config: defaults mirror conf/default.yaml, overrides, and one-line errors."""

from __future__ import annotations

import subprocess
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from elastictrain.core.config import Config
from elastictrain.core.config_load import load_config
from elastictrain.core.config_errors import _model_at
from elastictrain.core.errors import ConfigError
from tests.conftest import python_command

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_conf_default_yaml_is_the_schema_defaults():
    assert yaml.safe_load((REPO_ROOT / "conf" / "default.yaml").read_text()) == load_config().to_dict()
    assert load_config(REPO_ROOT / "conf" / "default.yaml") == load_config()


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 8\nsnapshot:\n  durable:\n    url: memory://a\n")
    cfg = load_config(path, ["train.batch_size=16", "dist.distributed=false", "task.args.hidden=32", "train.max_steps=null"])
    assert cfg.train.batch_size == 16 and cfg.dist.distributed is False
    assert cfg.task.args == {"hidden": 32} and cfg.train.max_steps is None
    assert cfg.durable_snapshot_url == "memory://a"
    assert load_config(None, ["run.name=x"]).durable_snapshot_url == str(Path("runs") / "x" / "snapshots")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.bach_size=3"], "unknown key 'train.bach_size' (did you mean 'train.batch_size'?)"),
        (["trian.max_epochs=3"], "unknown key 'trian' (did you mean 'train'?)"),
        (["train.batch_size=abc"], "'train.batch_size' = 'abc' is invalid: Input should be a valid integer"),
        (["train.batch_size=0"], "(expected int > 0)"),
        (["dist.distributed=maybe"], "'dist.distributed' = 'maybe' is invalid (expected bool or one of 'auto')"),
        (["train.lr_scheduler_interval=week"], "expected one of 'step', 'epoch'"),
        (["preempt.signals=[SIGFOO]"], "'preempt.signals' = 'SIGFOO' is invalid (expected list, each one of "
         "'SIGTERM', 'SIGINT', 'SIGUSR1', 'SIGUSR2', 'SIGHUP')"),
        (["train"], "not of the form key.sub=value"),
        (["train.batch_size=3", "train.batch_size.x=1"], "train.batch_size is a value, not a section"),
        (["snapshot.local=/dev/shm"], "'snapshot.local' = '/dev/shm' is invalid: it is a section, not a value; set its "
         "keys (url, every_steps, every_s, mtbf_prior_s, keep_last, async_write, survivor_copies), e.g. snapshot.local.url=..."),
        (["snapshot.durable.every_seconds=60"], "unknown key 'snapshot.durable.every_seconds' (did you mean "
         "'snapshot.durable.every_s'?)"),
    ],
)
def test_bad_values_are_one_clear_message(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_task_section_must_name_its_factory(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  args: {hidden: 3}\n")
    with pytest.raises(ConfigError, match=r"'task.factory' is required \(expected str\) but missing"):
        load_config(path)


def test_unreadable_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.bach_size=3"], "did you mean 'train.batch_size'?"),
        (["task.factory=no_such_module:build"], "cannot import 'no_such_module'"),
        (["task.factory=elastictrain.train.tasks.spirals:nope"], "has no function 'nope'"),
        (["task.args.no_such_arg=1"], "task.args do not fit elastictrain.train.tasks.spirals:build"),
    ],
)
def test_cli_prints_one_line_and_exits_non_zero_without_traceback(tmp_path, args, expected):
    done = subprocess.run(
        python_command([f"run.dir={tmp_path}", *args]),
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("elastictrain: error:")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert not (tmp_path / "snapshots").exists(), "nothing may be written before the config is known good"


def test_config_is_a_typed_tree():
    cfg = load_config()
    # Sections are attributes and values have their types: the values conf/default.yaml documents.
    assert (cfg.run.name, cfg.train.batch_size, cfg.train.max_steps, cfg.data.shuffle) == ("default", 32, None, True)
    cfg.train.batch_size = "16"  # validated and converted on assignment too
    assert cfg.train.batch_size == 16 and type(cfg.train.batch_size) is int
    with pytest.raises(ValidationError):
        cfg.train.batch_size = "x"
    assert cfg.train.batch_size == 16


@pytest.mark.parametrize(
    "url, local",
    [(None, True), ("/shared/runs/x", True), ("file:///shared/x", True), ("LOCAL://x", True),
     ("s3://bucket/run", False), ("memory://x", False), ("simplecache::s3://bucket/run", False)],
)
def test_storage_options_are_refused_only_where_fsspec_would_ignore_them(url, local):
    overrides = ["snapshot.durable.storage_options.endpoint_url=http://127.0.0.1:9000", *([f"snapshot.durable.url={url}"] if url else [])]
    if local:
        with pytest.raises(ConfigError, match=r"snapshot.durable.storage_options \(endpoint_url\) are ignored for the local path"):
            load_config(None, overrides)
    else:
        assert load_config(None, overrides).snapshot.durable.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert load_config(None, overrides[1:]).snapshot.durable.storage_options == {}  # no options: any URL


# Floats that are not durations; every other float key is one, in seconds, and its name ends in _s.
NOT_DURATIONS = {"train.clip_grad_norm", "watchdog.step_multiple", "stragglers.factor", "anomaly.spike_factor"}


def _leaves(model, prefix=""):
    for name, field in model.model_fields.items():
        inner = _model_at((prefix + name).split("."), Config)
        yield from _leaves(inner, f"{prefix}{name}.") if inner is not None else [(prefix + name, field)]


def _takes_floats(annotation) -> bool:
    return annotation is float or any(_takes_floats(arg) for arg in typing.get_args(annotation))


def test_every_duration_key_is_in_seconds_and_ends_in_s():
    durations = [key for key, field in _leaves(Config) if _takes_floats(field.annotation) and key not in NOT_DURATIONS]
    assert "snapshot.local.every_s" in durations and "watchdog.hang_timeout_s" in durations
    assert [key for key in durations if not key.endswith("_s")] == []
    assert [key for key, _ in _leaves(Config) if any(word in key for word in ("second", "_ms", "minute", "hour"))] == []


def _number_keys():
    """Every numeric key of the schema (int or float, alone, in a union without bool, or a list of them)."""
    from elastictrain.core.config import number_kind
    return {key: number_kind(field.annotation) for key, field in _leaves(Config) if number_kind(field.annotation)}


def test_the_numeric_keys_come_from_the_schema():
    keys = _number_keys()
    assert keys["train.batch_size"] == "number" and keys["anomaly.skip_samples"] == "list"
    assert keys["snapshot.local.every_s"] == "number"  # a float or 'auto'
    assert "anomaly.check_gradients" not in keys and "dist.distributed" not in keys  # bool or 'auto': true is meant
    assert len(keys) > 30


@pytest.mark.parametrize("key", sorted(_number_keys()))
def test_no_numeric_key_takes_a_boolean(key):
    """train.batch_size=true once trained with batch size 1: a boolean is refused in one line naming the key."""
    value = "[true]" if _number_keys()[key] == "list" else "true"
    # YAML reads a bare `off` as false: for the thread count, false is `off` (the test below).
    for given in (value,) if key == "train.intra_op_threads" else (value, value.replace("true", "false")):
        with pytest.raises(ConfigError) as caught:
            load_config(None, [f"{key}={given}"])
        message = str(caught.value)
        assert f"'{key}' = " in message and "a boolean where a number is meant" in message and "\n" not in message


def test_yaml_off_still_turns_the_thread_count_off_and_booleans_stay_booleans():
    cfg = load_config(None, ["train.intra_op_threads=off", "dist.distributed=false", "anomaly.check_gradients=true"])
    assert cfg.train.intra_op_threads == "off" and cfg.dist.distributed is False and cfg.anomaly.check_gradients is True


@pytest.mark.parametrize("source, overrides, expected", [
    ("missing.yaml", [], "config file missing.yaml does not exist; pass the path of an existing YAML file"),  # not "to --config"
    ("empty.yaml", [], "config file empty.yaml is empty (no keys); write the keys to change in it (run:, train:, ...), or "
                       "pass no config file to train on the defaults"),  # before: trained on the defaults silently
    (None, "train.max_epochs=2", "overrides='train.max_epochs=2' is a string; pass a list of key.sub=value strings: "
                                 "overrides=['train.max_epochs=2']"),  # before: "override 't' is not of the form ..."
])
def test_config_sources_that_mislead_are_one_line_saying_what_to_do(tmp_path, monkeypatch, source, overrides, expected):
    from elastictrain.core.config_load import load_config
    from elastictrain.core.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.yaml").write_text("# nothing here yet\n")
    with pytest.raises(ConfigError) as caught:
        load_config(source, overrides)
    assert str(caught.value) == expected

"""The typed config: defaults mirror conf/default.yaml, overrides, and one-line errors."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from elastictrain.config import load_config
from elastictrain.errors import ConfigError
from tests.conftest import python_command

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_conf_default_yaml_is_the_schema_defaults():
    assert yaml.safe_load((REPO_ROOT / "conf" / "default.yaml").read_text()) == load_config().to_dict()
    assert load_config(REPO_ROOT / "conf" / "default.yaml") == load_config()


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  batch_size: 8\nsnapshot:\n  url: memory://a\n")
    cfg = load_config(path, ["train.batch_size=16", "dist.distributed=false", "task.args.hidden=32", "train.max_steps=null"])
    assert cfg.train.batch_size == 16 and cfg.dist.distributed is False
    assert cfg.task.args == {"hidden": 32} and cfg.train.max_steps is None
    assert cfg.snapshot_url == "memory://a"
    assert load_config(None, ["run.name=x"]).snapshot_url == str(Path("runs") / "x" / "snapshots")


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
        (["task.factory=elastictrain.tasks.spirals:nope"], "has no function 'nope'"),
        (["task.args.no_such_arg=1"], "task.args do not fit elastictrain.tasks.spirals:build"),
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
    overrides = ["snapshot.storage_options.endpoint_url=http://127.0.0.1:9000", *([f"snapshot.url={url}"] if url else [])]
    if local:
        with pytest.raises(ConfigError, match=r"snapshot.storage_options \(endpoint_url\) are ignored for the local path"):
            load_config(None, overrides)
    else:
        assert load_config(None, overrides).snapshot.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert load_config(None, overrides[1:]).snapshot.storage_options == {}  # no options: any URL

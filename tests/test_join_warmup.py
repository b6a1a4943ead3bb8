"""A node joining a running job warms its workers' interpreter first: when, and with which arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastictrain.launcher.join_warmup import joins_running_job, warmstart_args

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("argv, expected", [
    # the workers start through warmstart: what torchrun hands it
    (["--nnodes=1:2", "--rdzv-backend=elastictrain-c10d", "-m", "elastictrain.launcher.warmstart", "--preload",
      "s3fs", "-m", "elastictrain", "train", "a=1"], ["--preload", "s3fs", "-m", "elastictrain", "train", "a=1"]),
    (["--nproc-per-node=2", "--module", "elastictrain.launcher.warmstart", "train.py", "--lr", "0.1"],
     ["train.py", "--lr", "0.1"]),
    # not through warmstart: nothing to warm
    (["--nnodes=1:2", "-m", "elastictrain", "train"], None),
    (["--nnodes=1:2", "train.py", "elastictrain.launcher.warmstart"], None),
    (["--no-python", "elastictrain.launcher.warmstart"], None),
    (["--run-path", "elastictrain.launcher.warmstart"], None),
    (["--not-a-torchrun-flag"], None),  # not torchrun's command line at all
])
def test_the_workers_warmstart_arguments_come_from_torchruns_command_line(argv, expected):
    assert warmstart_args(argv) == expected


@pytest.mark.parametrize("state, running", [
    (SimpleNamespace(complete=True, participants={"node-a": 0}), True),  # a group is training
    (SimpleNamespace(complete=False, participants={"node-a": 0}), False),  # a fresh job's round, still open
    (SimpleNamespace(complete=True, participants={}), False),  # every node left
    (SimpleNamespace(complete=False, participants={}), False),
])
def test_only_a_node_joining_a_training_group_warms_up_first(state, running):
    assert joins_running_job(state) is running

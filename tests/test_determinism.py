"""The CUDA determinism settings (elastictrain/core/determinism.py): decided from the device as a table, applied once.

The decision and its line are tested here without a GPU; the settings on a real CUDA run (and that they
make a resume bitwise) are the cuda tier's (tests/test_resume.py's cuda variants).
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from elastictrain.core import determinism
from elastictrain.core.config import DistConfig
from elastictrain.core.determinism import CUBLAS_VARIABLE, DeterminismSettings, apply, decide
from elastictrain.dist.group import setup

CPU, CUDA0, CUDA1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


@pytest.mark.parametrize("device, enabled, environ, expected", [
    (CPU, True, {}, None),  # the CPU needs its threads pinned (threads.py), nothing here
    (CPU, False, {CUBLAS_VARIABLE: ":16:8"}, None),
    (CUDA0, True, {}, DeterminismSettings(True, ":4096:8", False)),
    (CUDA1, True, {"OTHER": "1"}, DeterminismSettings(True, ":4096:8", False)),
    (CUDA0, True, {CUBLAS_VARIABLE: ":16:8"}, DeterminismSettings(True, ":16:8", True)),  # the user's value is kept
    (CUDA0, True, {CUBLAS_VARIABLE: ""}, DeterminismSettings(True, ":4096:8", False)),  # empty reads as unset
    (CUDA0, False, {}, DeterminismSettings(False, None, False)),
    (CUDA0, False, {CUBLAS_VARIABLE: ":16:8"}, DeterminismSettings(False, None, False)),
])
def test_the_settings_are_decided_from_the_device_the_switch_and_the_environment(device, enabled, environ, expected):
    assert decide(device, enabled, environ) == expected


@pytest.mark.parametrize("settings, line", [
    (DeterminismSettings(True, ":4096:8", False),
     "CUDA determinism for bitwise resume: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8; "
     "dist.deterministic=false turns both off"),
    (DeterminismSettings(True, ":16:8", True),
     "CUDA determinism for bitwise resume: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:16:8 "
     "(the environment's); dist.deterministic=false turns both off"),
    (DeterminismSettings(False, None, False),
     "CUDA determinism off (dist.deterministic=false): torch's default kernels, cuBLAS's default workspace; a resume "
     "is not bitwise equal to an unbroken run"),
])
def test_the_start_up_line_names_every_setting_and_the_key_that_turns_them_off(settings, line):
    assert settings.line() == line


@pytest.fixture
def deterministic_restored():
    """The settings are process-wide: put torch's and the environment's back for the next test in this process."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    variable = os.environ.pop(CUBLAS_VARIABLE, None)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    os.environ.pop(CUBLAS_VARIABLE, None)
    if variable is not None:
        os.environ[CUBLAS_VARIABLE] = variable


def test_apply_sets_the_algorithms_and_the_cublas_variable_and_returns_the_line(deterministic_restored):
    torch.use_deterministic_algorithms(False)
    environ: dict[str, str] = {}
    line = apply(decide(CUDA0, True, environ), environ)
    assert torch.are_deterministic_algorithms_enabled()
    assert environ == {CUBLAS_VARIABLE: ":4096:8"}
    assert line.startswith("CUDA determinism for bitwise resume: ")


def test_apply_leaves_everything_alone_on_the_cpu_and_when_turned_off(deterministic_restored):
    torch.use_deterministic_algorithms(False)
    environ: dict[str, str] = {}
    assert apply(decide(CPU, True, environ), environ) is None
    assert apply(decide(CUDA0, False, environ), environ).startswith("CUDA determinism off")
    assert not torch.are_deterministic_algorithms_enabled() and environ == {}


def test_setup_on_the_cpu_sets_nothing_and_says_nothing(deterministic_restored, caplog):
    # The call site in dist.setup: on the CPU the decision is None, nothing is applied, no line is logged.
    torch.use_deterministic_algorithms(False)
    with caplog.at_level(logging.INFO, logger="elastictrain"):
        ctx = setup(DistConfig(device="cpu"), environ={})
    assert ctx.device == CPU
    assert not torch.are_deterministic_algorithms_enabled()
    assert CUBLAS_VARIABLE not in os.environ
    assert not [r for r in caplog.records if "determinism" in r.getMessage()]


def test_setup_applies_the_decision_for_its_device(deterministic_restored, caplog, monkeypatch):
    # dist.setup hands its chosen device to determinism.decide: a decision for a CUDA device (as the GPU tier
    # makes it) is applied and logged in one line. The device is the CPU here: decide is given CUDA's answer.
    torch.use_deterministic_algorithms(False)
    seen = []
    real_decide = determinism.decide

    def decide_as_on_cuda(device, enabled, environ):
        seen.append((device, enabled))
        return real_decide(CUDA0, enabled, environ)

    monkeypatch.setattr(determinism, "decide", decide_as_on_cuda)
    with caplog.at_level(logging.INFO, logger="elastictrain"):
        setup(DistConfig(device="cpu"), environ={})
    assert seen == [(CPU, True)]
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ[CUBLAS_VARIABLE] == ":4096:8"
    assert [r.getMessage() for r in caplog.records if "determinism" in r.getMessage()] == [
        "CUDA determinism for bitwise resume: torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8; "
        "dist.deterministic=false turns both off"]

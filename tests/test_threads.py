"""ThreadPin: the thread count a run computes with, and the runtime's dynamic threading, held still.

MKL's own verbose line (``MKL_VERBOSE=1``: ``CNR:<mode> Dyn:<0|1> ... NThr:<n>``) is the witness for
what MKL does, in a fresh interpreter so the first MKL call is the one under test.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from elastictrain.core.threads import ThreadPin, cpu_capability

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch build has no MKL")


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_python(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**_base_env(), **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "OMP_"))}


@pytest.mark.slow
@needs_mkl
def test_a_pinned_worker_runs_mkl_with_deterministic_scheduling_and_no_dynamic_threads():
    out = run_python(
        "import elastictrain, torch\n"
        "from elastictrain.core.threads import ThreadPin\n"
        "ThreadPin(2).start()\n"
        "a = torch.ones(64, 64); a @ a\n",
        MKL_VERBOSE="1",
    )
    assert "CNR:AUTO Dyn:0" in out and "NThr:2" in out, out


@pytest.mark.slow
@needs_mkl
def test_unpinned_mkl_schedules_dynamically():  # what the pin changes: out of the box MKL says CNR:OFF Dyn:1
    out = run_python("import torch\na = torch.ones(64, 64); a @ a\n", MKL_VERBOSE="1")
    assert "CNR:OFF Dyn:1" in out, out


@pytest.mark.slow
@needs_mkl
def test_the_startup_line_says_when_mkl_ran_before_elastictrain_was_imported():
    late = run_python(
        "import torch\ntorch.ones(16, 16) @ torch.ones(16, 16)\n"
        "from elastictrain.core.threads import ThreadPin\np = ThreadPin(); p.start(); print(p.report())\n"
    )
    assert "MKL CNR OFF" in late and "import elastictrain first, or set MKL_CBWR=AUTO" in late, late
    early = run_python(
        "import elastictrain, torch\ntorch.ones(16, 16) @ torch.ones(16, 16)\n"
        "from elastictrain.core.threads import ThreadPin\np = ThreadPin(); p.start(); print(p.report())\n"
    )
    assert "MKL CNR AUTO, dynamic off" in early and "import elastictrain first" not in early, early


def test_auto_pins_the_count_the_snapshot_carries():
    torch.set_num_threads(2)
    pin = ThreadPin("auto")
    pin.start()
    assert torch.get_num_threads() == 2 and pin.state_dict()["intra_op_threads"] == 2
    pin.load_state_dict({"intra_op_threads": 1, "cpu_capability": cpu_capability()})
    assert torch.get_num_threads() == 1
    assert "1 intra-op thread" in pin.report() and "recorded at its first start" in pin.report()


def test_a_count_set_by_the_user_wins_and_a_snapshot_of_another_count_is_named(caplog):
    torch.set_num_threads(2)
    pin = ThreadPin(1)
    pin.start()
    assert torch.get_num_threads() == 1
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        pin.load_state_dict({"intra_op_threads": 2, "cpu_capability": cpu_capability()})
    assert torch.get_num_threads() == 1
    assert "computed with 2 intra-op threads, this worker has 1" in caplog.text


def test_off_leaves_the_count_alone(caplog):
    torch.set_num_threads(2)
    pin = ThreadPin("off")
    pin.start()
    with caplog.at_level(logging.WARNING, logger="elastictrain"):
        pin.load_state_dict({"intra_op_threads": 1, "cpu_capability": cpu_capability()})
    assert torch.get_num_threads() == 2
    assert "computed with 1 intra-op threads, this worker has 2" in caplog.text
    assert pin.report().startswith("threads not pinned (train.intra_op_threads=off)")


def test_a_snapshot_from_another_kernel_set_is_named_in_the_startup_line():
    pin = ThreadPin("auto")
    pin.start()
    pin.load_state_dict({"intra_op_threads": torch.get_num_threads(), "cpu_capability": "AVX512_SOMETHING"})
    assert "computed with AVX512_SOMETHING kernels, this CPU runs" in pin.report()
    assert "bits need the same CPU type" in pin.report()


@pytest.mark.parametrize(("given", "expected"), [("off", "off"), ("auto", "auto"), ("3", 3)])
def test_the_setting_reads_as_written_on_the_command_line(given, expected):
    from elastictrain.core.config_load import load_config

    assert load_config(None, [f"train.intra_op_threads={given}"]).train.intra_op_threads == expected  # YAML: off is false


def test_a_setting_that_is_no_count_is_one_line():
    from elastictrain.core.config_load import load_config
    from elastictrain.core.errors import ConfigError

    with pytest.raises(ConfigError, match="train.intra_op_threads"):
        load_config(None, ["train.intra_op_threads=true"])

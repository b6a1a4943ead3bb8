"""core/signals.py: which worker asks the kernel for a signal when its launcher exits, and that uninstall undoes it.

One short process per case (the setting belongs to the process); the kernel's delivery after a real SIGKILL of
the agent is what tests/faults/test_preemption.py (a worker torchrun started) and tests/test_elastic.py (a warm
child, through its client) check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastictrain.core.signals import LAUNCHER_EXIT_SIGNAL, WARM_CHILD_ENV

REPORT = """
import json
from elastictrain.core.processes import parent_death_signal
from elastictrain.core.signals import PreemptionSignals
signals = PreemptionSignals(NAMES)
signals.install()
installed = parent_death_signal()
signals.uninstall()
print(json.dumps([installed, parent_death_signal()]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize(
    ("env", "names", "tied"),
    [
        ({"TORCHELASTIC_RUN_ID": "job"}, ["SIGTERM"], True),  # a worker torchrun started
        ({"TORCHELASTIC_RUN_ID": "job", WARM_CHILD_ENV: "123"}, ["SIGTERM"], False),  # its parent: the warm server
        ({}, ["SIGTERM"], False),  # no launcher to outlive
        ({"TORCHELASTIC_RUN_ID": "job"}, [], False),  # preemption signals off: the launcher's exit is not one either
    ],
)
def test_only_a_worker_torchrun_started_asks_for_a_signal_when_its_agent_exits(env, names, tied):
    base = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", WARM_CHILD_ENV)}
    done = subprocess.run([sys.executable, "-c", REPORT.replace("NAMES", repr(names))], env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=True)
    installed, after = json.loads(done.stdout)
    assert installed == (LAUNCHER_EXIT_SIGNAL if tied else 0)
    assert after == 0, "uninstall() gives the setting back"

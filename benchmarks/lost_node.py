"""Measure what a lost node costs: SIGKILL of a whole node (agent and worker) -> the smaller world restored.

Two torchrun agents on 127.0.0.1 are the two nodes of one ``--nnodes=1:2`` job (the shipped
``launch/torchrun/multi_node.sh``, the ``elastictrain-c10d`` rendezvous, warm restarts, one worker
per node, ``--rdzv-conf`` as the elastic guide's recipe: ``last_call_timeout=0.5``,
``keep_alive_interval=0.25``, ``keep_alive_max_attempt=6``, fractions of a second that
``elastictrain-c10d`` takes). When rank 1 reaches step 37 its node is
SIGKILLed; the survivor goes on alone from the snapshot of step 25. From the worker's own
millisecond log lines, each trial splits the time from the kill into:

- ``detect_s``: until the surviving rank's "lost a peer" line (its collective failed);
- ``exit_s``: until the survivor's agent saw its worker exit;
- ``regroup_s``: until the new attempt's worker is set up at world size 1 (the agent's new
  rendezvous round: the lost node declared dead after ``keep_alive_interval`` x
  ``keep_alive_max_attempt``, then ``last_call_timeout``; the worker started);
- ``restore_s``: until its "restored snapshot" line;
- ``total_s``: the kill to the restored world of one.

``--fault agent`` SIGKILLs node 1's agent only: its worker, told by the kernel that its parent exited, stops
the group at an agreed step with a snapshot (``detect_s`` then ends at the survivor's PREEMPTED line), and the
survivor's agent regroups without node 1 as above.

``--burners N`` runs N CPU-bound processes beside the job; every trial records the load average at
the kill. A trial whose first rendezvous round closed before node 1's agent joined it (node 0 then
trains the whole short job alone, ends, and takes the store with it) measures no lost node: it is
counted (``missed_first_round``) and run again.

    PYTHONPATH=. .venv/bin/python benchmarks/lost_node.py --trials 3 --burners 6 --out benchmarks/results/lost_node_loaded.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time

from tests.conftest import WARM
from tests.helpers import procs
from tests.helpers.agents import NodeGroup

KILL_STEP = 37
JOB = [
    "task.factory=tests.helpers.tasks:build",
    "train.max_epochs=1",
    "train.batch_size=16",
    "train.log_every_steps=10",
    "snapshot.durable.every_steps=25",
    "log.plots=false",
    "log.progress_bar=false",
]
RDZV_CONF = {"last_call_timeout": 0.5, "keep_alive_interval": 0.25, "keep_alive_max_attempt": 6}
STAMP = r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[elastictrain r0 "
# The survivor's first sign of the fault: its collective failed (the node SIGKILLed), or the group's agreed stop
# (its agent alone SIGKILLed, its worker told by the kernel).
DETECTED = {
    "node": re.compile(STAMP + r"a0\] .*lost a peer", re.MULTILINE),
    "agent": re.compile(STAMP + r"a0\] INFO state \w+ -> PREEMPTED", re.MULTILINE),
}
LINES = {
    # torch's agent: the worker's exit seen (its glog line: E<month><day> hh:mm:ss.micros)
    "exited": re.compile(r"^E\d{4} (\d\d):(\d\d):(\d\d)\.(\d{3})\d* .*failed \(exitcode", re.MULTILINE),
    "up": re.compile(STAMP + r"a1\] INFO state SETUP -> RESTORE", re.MULTILINE),  # the new worker set up
    "restored": re.compile(STAMP + r"a1\] INFO restored snapshot", re.MULTILINE),
}
TIMEOUT_S = 180


def line_unix(match: re.Match, near_unix: float) -> float:
    day = datetime.datetime.fromtimestamp(near_unix)
    hours, minutes, seconds, millis = (int(group) for group in match.groups())
    return day.replace(hour=hours, minute=minutes, second=seconds, microsecond=millis * 1000).timestamp()


class MissedFirstRound(Exception):
    """Node 1's agent reached the rendezvous after its first round had closed with node 0 alone."""


def trial(workdir: pathlib.Path, rdzv_conf: dict[str, object], fault: str = "node") -> dict[str, float]:
    trace_dir = workdir / "trace"
    trace_dir.mkdir(parents=True)
    overrides = [*JOB, f"run.dir={workdir / 'run'}", f"task.args.trace_dir={trace_dir}",
                 f"task.args.pauses=[[1,{KILL_STEP}]]"]
    nodes = NodeGroup(workdir, [*WARM, "-m", "elastictrain", "train", *overrides], nnodes="1:2", rdzv_conf=rdzv_conf,
                      env={"OMP_NUM_THREADS": "1", "RDZV_BACKEND": "elastictrain-c10d"})
    try:
        nodes.launch(0, host_store=True)
        nodes.launch(1, host_store=False)
        try:
            procs.wait_for_file(trace_dir / f"paused-rank1-call{KILL_STEP}.pid", TIMEOUT_S, nodes.agents[1])
        except AssertionError:
            if "starting fresh (world size 1)" in nodes.agents[0].output():
                raise MissedFirstRound() from None
            raise
        load = os.getloadavg()[0]
        killed_unix = time.time()
        if fault == "agent":
            os.kill(nodes.agents[1].proc.pid, signal.SIGKILL)
            (trace_dir / f"paused-rank1-call{KILL_STEP}.resume").write_text("")  # its worker goes on, an orphan
        else:
            nodes.kill(1)
        survivor = nodes.agents[0]
        survivor.wait_for(lambda out: LINES["restored"].search(out) is not None, TIMEOUT_S, "the world of one restored")
        assert survivor.wait(TIMEOUT_S) == 0, survivor.output()[-4000:]
        output = survivor.output()
        found = {name: pattern.search(output) for name, pattern in {"lost": DETECTED[fault], **LINES}.items()}
        missing = [name for name, match in found.items() if match is None]
        assert not missing, f"no {missing} line in the survivor's output:\n{output[-6000:]}"
        at = {name: line_unix(match, killed_unix) for name, match in found.items() if match is not None}
        return {"load": round(load, 2), "detect_s": round(at["lost"] - killed_unix, 3),
                "exit_s": round(at["exited"] - at["lost"], 3), "regroup_s": round(at["up"] - at["exited"], 3),
                "restore_s": round(at["restored"] - at["up"], 3), "total_s": round(at["restored"] - killed_unix, 3)}
    finally:
        for agent in nodes.agents.values():
            agent.kill_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes beside the job")
    parser.add_argument("--fault", choices=("node", "agent"), default="node",
                        help="SIGKILL node 1's agent and worker (node), or its agent only (agent)")
    parser.add_argument("--rdzv-conf", default=",".join(f"{k}={v}" for k, v in RDZV_CONF.items()),
                        help="torchrun's --rdzv-conf for both agents (default: the elastic recipe's)")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    rdzv_conf = dict(pair.split("=", 1) for pair in args.rdzv_conf.split(","))
    with procs.cpu_burners(args.burners):
        trials, missed = [], 0
        while len(trials) < args.trials:
            with tempfile.TemporaryDirectory() as scratch:
                try:
                    trials.append(trial(pathlib.Path(scratch), rdzv_conf, args.fault))
                except MissedFirstRound:
                    missed += 1
                    print("node 1 missed the first round: node 0 trained alone; run again", flush=True)
                    if missed > 3 * args.trials:
                        raise
                    continue
            print(f"trial {len(trials)}: {trials[-1]}", flush=True)
    summary = {key: statistics.median(t[key] for t in trials) for key in trials[0]}
    result = {"command": " ".join(sys.argv), "fault": args.fault, "rdzv_conf": rdzv_conf, "trials": trials, "missed_first_round": missed,
              "median": summary}
    print(json.dumps(result["median"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Start N torchrun agents on 127.0.0.1 as the N "nodes" of one multi-node job.

Every agent runs the shipped ``launch/torchrun/multi_node.sh`` (c10d rendezvous, the endpoint
and run id from the environment), so a test exercises the recipe users copy, not a re-typed
command line. Each agent is its own process tree started by ``procs.launch``: it can be
launched, signalled or killed on its own (a node joining, being preempted, or dying), and
the autouse reaper in conftest.py kills whatever is left after the test.

    nodes = NodeGroup(tmp_path, ["-m", "elastictrain", "train", "train.max_epochs=2"], nnodes="2")
    nodes.launch(0, host_store=True)
    nodes.launch(1)
    assert nodes.wait(120) == {0: 0, 1: 0}
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import procs

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
MULTI_NODE_SCRIPT = REPO_ROOT / "launch" / "torchrun" / "multi_node.sh"
# The torchrun of the interpreter running the tests (the venv's), not whatever is on PATH.
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class NodeGroup:
    """The agents of one torchrun job, each a "node" on this machine, launched one by one.

    command: what follows the torchrun flags (``-m elastictrain train ...`` or a script and
    its arguments). nnodes: ``"N"`` or ``"MIN:MAX"``. extra_args: torchrun flags for every
    agent; ``launch(..., extra_args=)`` adds flags for one agent.
    """

    tmp_path: Path
    command: list[str]
    nnodes: str = "2"
    nproc_per_node: int = 1
    rdzv_id: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:12]}")
    endpoint: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    max_restarts: int = 3
    shutdown_timeout_s: int = 30
    extra_args: list[str] = field(default_factory=list)
    # --rdzv-conf for every agent, e.g. {"last_call_timeout": 1}; launch(host_store=) adds is_host.
    rdzv_conf: dict[str, object] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    agents: dict[int, procs.Launched] = field(default_factory=dict)  # the latest launch of each index
    launches: dict[int, int] = field(default_factory=dict)

    def launch(self, index: int, *, host_store: bool | None = None, extra_args: list[str] = ()) -> procs.Launched:
        """Start agent ``index`` (its log is ``<tmp_path>/agent-<index>.log``, ``agent-<index>-<n>.log`` for its n-th relaunch).

        host_store=True makes this agent host the c10d store at the endpoint, False makes it a
        client only; None leaves it to torch (every agent whose address matches tries to host).
        """
        if index in self.agents and self.agents[index].proc.poll() is None:
            raise ValueError(f"agent {index} is still running (pid {self.agents[index].proc.pid})")
        flags = [
            # Fast failure detection for tests; the rendezvous store and the worker store on
            # loopback, since every "node" is this machine. Each agent has a loopback address of
            # its own (127.0.0.<index + 1>): torch orders a round's nodes by address, then pid, and
            # pids wrap (pid_max is 32768 here), so this keeps agent i at node rank i.
            "--monitor-interval=0.1", f"--local-addr=127.0.0.{index + 1}", *self.extra_args, *extra_args,
        ]
        rdzv_conf = dict(self.rdzv_conf)
        if host_store is not None:
            rdzv_conf["is_host"] = int(host_store)
        if rdzv_conf:  # torchrun takes one --rdzv-conf (a later one replaces an earlier one)
            flags.append("--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in rdzv_conf.items()))
        env = {
            "TORCHRUN": TORCHRUN,
            "TORCHRUN_ARGS": " ".join(flags),
            "RDZV_ENDPOINT": self.endpoint,
            "RDZV_ID": self.rdzv_id,
            "NNODES": self.nnodes,
            "NPROC_PER_NODE": str(self.nproc_per_node),
            "MAX_RESTARTS": str(self.max_restarts),
            "SHUTDOWN_TIMEOUT_S": str(self.shutdown_timeout_s),
            # Workers import test tasks (tests.helpers.tasks) from the repository root.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            **self.env,
        }
        launches = self.launches.get(index, 0)
        log_name = f"agent-{index}.log" if launches == 0 else f"agent-{index}-{launches + 1}.log"
        agent = procs.launch(
            ["bash", str(MULTI_NODE_SCRIPT), *self.command], log_path=self.tmp_path / log_name, env=env, cwd=self.tmp_path,
        )
        self.agents[index] = agent
        self.launches[index] = launches + 1
        return agent

    def signal(self, index: int, signum: signal.Signals) -> None:
        """Send signum to agent ``index`` only (torchrun forwards the signals it handles to its workers)."""
        os.kill(self.agents[index].proc.pid, signum)

    def kill(self, index: int) -> None:
        """SIGKILL agent ``index`` and all its workers at once, as when a node is lost."""
        self.agents[index].kill_all()

    def wait(self, timeout_s: float) -> dict[int, int]:
        """Wait for every launched agent to exit; return {index: exit code}.

        All agents are watched together, so every worker of every node gets into its agent's
        seen_pids (and is killed by the reaper if it outlives its agent).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for agent in self.agents.values():
                agent.track()
            codes = {index: agent.proc.poll() for index, agent in sorted(self.agents.items())}
            if None not in codes.values():
                return codes
            if time.monotonic() > deadline:
                running = [index for index, code in codes.items() if code is None]
                for agent in self.agents.values():
                    agent.kill_all()
                raise AssertionError(
                    f"agents {running} still running after {timeout_s} s\n{self.output()[-6000:]}"
                )
            time.sleep(procs.POLL_INTERVAL_S)

    def worker_pids(self, index: int) -> set[int]:
        """Every pid ever seen under agent ``index``, the agent itself excluded."""
        agent = self.agents[index]
        return agent.seen_pids - {agent.proc.pid}

    def output(self) -> str:
        """Every agent's log, in index order, each under a header line."""
        return "\n".join(f"=== agent {index} ===\n{agent.output()}" for index, agent in sorted(self.agents.items()))

    def leftover_pids(self, grace_s: float = 10.0) -> list[int]:
        """Pids of any agent or worker still alive ``grace_s`` after the call at most: a warm-start server exits on
        its own a moment after its agent (it waits on the agent), later under load."""
        return procs.still_running(
            lambda: sorted(pid for agent in self.agents.values() for pid in agent.leftover_pids()), grace_s
        )

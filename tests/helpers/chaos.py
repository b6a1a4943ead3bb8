"""A chaos soak: a seeded schedule of every kind of fault, thrown at one two-node job; what must hold afterwards.

Shared by ``benchmarks/chaos.py`` (N minutes) and ``tests/test_chaos.py`` (two). The job: two torchrun agents as
two "nodes" on this machine (``tests/helpers/agents.py``, c10d, ``--nnodes=1:2``, one worker each), warm
restarts (``-m elastictrain.launcher.warmstart --preload s3fs``), the durable tier on SeaweedFS S3, the fast tier on a small tmpfs per
node, ``train.virtual_shards=2`` so that a world of one or two trains the same bits, the traced test task
(``tests/helpers/tasks.py``: each step sleeps a little, so the job lasts minutes and its processes are findable
by the trace files they write).

The faults (``KINDS``), each a real signal to a real pid or a real change on disk:

- ``worker-sigkill``: SIGKILL the training process of one rank (under warm restarts the forked child);
- ``worker-sigstop``: SIGSTOP it; its peer's watchdog finds it frozen and SIGKILLs it;
- ``agent-sigterm``: SIGTERM agent 1 (a preempted node): a snapshot, the other node goes on alone; relaunched later;
- ``node-loss``: SIGKILL agent 1 and its worker at once; relaunched later. Agent 0 hosts the c10d store and is
  never lost (with c10d its loss ends the job: README "Elastic training");
- ``s3-pause``: SIGSTOP the S3 server for a while, then SIGCONT;
- ``fast-copy-corrupt``: flip bytes in the newest fast copy of every node (the workers held by SIGSTOP so no newer
  one lands meanwhile), then SIGKILL a worker so that the restore must read it;
- ``local-tier-full``: fill node 0's fast-tier tmpfs with a file, free it a while later;
- ``nan-batch``: ``ELASTICTRAIN_FAULT=grad-inf@STEP`` on rank 0, set at launch: a transient fault that
  self-healing rolls back and replays clean.

Faults run one after another (the next starts once the one before has ended and both nodes train again), so
each one's cost can be read off the log on its own.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elastictrain.storage.manifest import MANIFEST_NAME
from elastictrain.snapshot.format import load_object
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.launcher.warmstart import server_prefix
from tests.helpers import procs
from tests.helpers.agents import NodeGroup

KINDS = ("worker-sigkill", "worker-sigstop", "agent-sigterm", "node-loss", "s3-pause", "fast-copy-corrupt",
         "local-tier-full", "nan-batch")
STEP_SLEEP_S = 0.03  # each training step of the task sleeps this long: minutes of training in a few thousand steps
TMPFS_SIZE = "8m"
SERVER_EXIT_S = 10.0  # a warm-start server exits on its own a moment after its agent (it waits on the agent)  # each node's fast tier
RDZV_CONF = {"last_call_timeout": 0.5, "keep_alive_interval": 0.25, "keep_alive_max_attempt": 6}  # the elastic guide's
ENV = {"OMP_NUM_THREADS": "1"}
TRAIN = [
    "task.factory=tests.helpers.tasks:build", f"task.args.step_sleep_s={STEP_SLEEP_S}",
    "train.batch_size=16", "train.virtual_shards=2", "train.max_epochs=1000", "train.eval_every_epochs=0",
    "train.log_every_steps=5", "log.plots=false", "anomaly.check_gradients=true",
]


@dataclass(frozen=True)
class Fault:
    """One fault: what, when (seconds of training: from when both nodes first trained), for how long (a pause, a
    node's absence, a full tier), on which rank."""

    kind: str
    at_s: float
    duration_s: float = 0.0
    rank: int = 0


def schedule(seed: int, duration_s: float, every_s: float = 30.0, kinds: tuple[str, ...] = KINDS,
             first_s: float | None = None, pause_s: tuple[float, float] = (20.0, 60.0),
             away_s: tuple[float, float] = (10.0, 30.0), full_s: tuple[float, float] = (5.0, 15.0)) -> list[Fault]:
    """About one fault every ``every_s`` of training from ``first_s`` to 80 % of ``duration_s``, kinds drawn from a shuffled bag
    (every kind once before any twice), jittered by up to a quarter interval; the same seed, the same list."""
    draw = random.Random(seed)
    first_s = every_s if first_s is None else first_s
    count = max(1, int((0.8 * duration_s - first_s) // every_s) + 1)
    bag: list[str] = []
    faults = []
    for index in range(count):
        if not bag:
            bag = list(kinds)
            draw.shuffle(bag)
        kind = bag.pop()
        if kind == "nan-batch" and any(fault.kind == kind for fault in faults):
            kind = "worker-sigkill"  # one NaN batch per job: ELASTICTRAIN_FAULT=grad-inf@STEP fires once
        at_s = first_s + index * every_s + draw.uniform(-every_s / 4, every_s / 4) * (index > 0)
        duration = {"s3-pause": draw.uniform(*pause_s), "agent-sigterm": draw.uniform(*away_s),
                    "node-loss": draw.uniform(*away_s), "local-tier-full": draw.uniform(*full_s)}.get(kind, 0.0)
        faults.append(Fault(kind, round(at_s, 1), round(duration, 1), draw.randrange(2)))
    return faults


@dataclass
class Applied:
    """What the runner did for one fault: when it began and ended (unix s), the pids it hit, what it saw."""

    fault: Fault
    began_unix: float = 0.0
    ended_unix: float = 0.0
    pids: list[int] = field(default_factory=list)
    note: str = ""


@dataclass
class ChaosJob:
    """The two-node job under faults. ``start()``, then ``run(faults)`` applies them and waits for the end."""

    workdir: Path
    s3: object  # tests.helpers.s3.S3Server
    bucket: str
    steps: int
    local_every_s: float = 2.0
    durable_every_s: float = 8.0
    nan_step: int | None = None
    timeout_s: float = 600.0
    nodes: NodeGroup | None = None
    launches: list[procs.Launched] = field(default_factory=list)  # every agent ever launched
    applied: list[Applied] = field(default_factory=list)
    launch_unix: float = 0.0
    end_unix: float = 0.0
    shm_before: set[str] = field(default_factory=set)
    _pids: dict[int, int] = field(default_factory=dict)  # rank -> training pid, as last looked up
    _hit: set[int] = field(default_factory=set)  # pids a fault already signalled: never chosen again
    first_step_unix: float = 0.0  # when both nodes first trained: the schedule's clock starts there

    @property
    def trace_dir(self) -> Path:
        return self.workdir / "trace"

    def fast_dir(self, node: int) -> Path:
        return self.workdir / f"fast-node{node}"

    @property
    def durable_url(self) -> str:
        return f"s3://{self.bucket}/run"

    def overrides(self) -> list[str]:
        return [*TRAIN, f"train.max_steps={self.steps}", f"run.dir={self.workdir / 'run'}",
                f"task.args.trace_dir={self.trace_dir}",
                f"snapshot.durable.url={self.durable_url}",
                f"snapshot.durable.storage_options.endpoint_url={self.s3.endpoint}",
                "snapshot.durable.every_steps=0", f"snapshot.durable.every_s={self.durable_every_s}",
                "snapshot.durable.async_write=true", "snapshot.durable.retry_for_s=5",
                f"snapshot.local.url={self.workdir}/fast-node$GROUP_RANK", f"snapshot.local.every_s={self.local_every_s}",
                # One copy kept: each copy is a new file. With two, a copy is written over the oldest one's files in
                # place (commit.py), needing no new pages, and a full tier showed only when a file outgrew its last page.
                "snapshot.local.keep_last=1"]

    def start(self) -> None:
        from tests.helpers.s3 import ACCESS_KEY, SECRET_KEY

        self.trace_dir.mkdir(parents=True)
        for node in (0, 1):  # each node's memory: a tmpfs of its own, so that it can be filled
            self.fast_dir(node).mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.fast_dir(node))],
                           check=True)
        env = {**ENV, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        if self.nan_step is not None:
            env |= {"ELASTICTRAIN_FAULT": f"grad-inf@{self.nan_step}:{self.workdir}", "ELASTICTRAIN_FAULT_RANK": "0"}
        self.shm_before = set(os.listdir("/dev/shm"))
        self.nodes = NodeGroup(self.workdir, ["-m", "elastictrain.launcher.warmstart", "--preload", "s3fs", "-m", "elastictrain", "train",
                                              *self.overrides()],
                               nnodes="1:2", rdzv_conf=RDZV_CONF, env=env, max_restarts=1000)
        self.launch_unix = time.time()
        self._launch(0)
        self._launch(1)

    def _launch(self, index: int) -> None:
        self.launches.append(self.nodes.launch(index, host_store=index == 0))

    # --- the job's processes, found from outside ---

    def training_pids(self) -> dict[int, int]:
        """rank -> pid of the live process that wrote that rank's newest trace file (the one computing its steps)."""
        newest: dict[int, tuple[str, int]] = {}
        for path in self.trace_dir.glob("rank*-pid*.jsonl"):
            match = re.fullmatch(r"rank(\d+)-(\d+)-pid(\d+)\.jsonl", path.name)
            rank, pid = int(match[1]), int(match[3])
            if pid not in self._hit and procs.pid_alive(pid) and (rank not in newest or match[2] > newest[rank][0]):
                newest[rank] = (match[2], pid)
        return {rank: pid for rank, (_, pid) in newest.items()}

    def steps_done(self) -> int:
        found = STEP_LINE.findall(self.output())
        return max((int(step) for *_, step in found), default=0)

    def both_training(self, pids: dict[int, int]) -> bool:
        """Both agents up, a world of two (``pids``: rank -> training pid), and its steps going on (rank 1 has
        written a trace line lately)."""
        agents = self.nodes.agents
        if any(agents[i].proc.poll() is not None for i in (0, 1)):
            return False
        if set(pids) != {0, 1}:
            return False
        newest = max(self.trace_dir.glob(f"rank1-*-pid{pids[1]}.jsonl"))
        return newest.stat().st_size > 0 and time.time() - newest.stat().st_mtime < 1.0

    def output(self) -> str:
        return "\n".join(launched.output() for launched in self.launches)

    # --- the faults ---

    def run(self, faults: list[Fault]) -> None:
        """Apply ``faults`` (all but nan-batch) in order, each once the one before ended and both nodes train
        again; then wait for the agents to exit. Raises if the job ends or times out first."""
        deadline = self.launch_unix + self.timeout_s
        self._wait(lambda: self._ready_for(Fault("start", 0.0)), deadline, "both nodes to train")
        self.first_step_unix = time.time()
        for fault in faults:
            if fault.kind == "nan-batch":
                continue
            while True:
                self._wait(lambda: time.time() - self.first_step_unix >= fault.at_s and self._ready_for(fault), deadline,
                           f"{fault.kind} at {fault.at_s} s")
                try:
                    self.applied.append(self._apply(fault, deadline))
                    break
                except ProcessLookupError:  # the worker it chose exited meanwhile (a restart): choose again
                    continue
            done = self.applied[-1]
            self._hit.update(done.pids)
            print(f"chaos: {fault.kind} at {done.began_unix - self.first_step_unix:.1f} s for "
                  f"{done.ended_unix - done.began_unix:.1f} s, pids {done.pids} {done.note}", file=sys.stderr, flush=True)
        self._wait(lambda: all(a.proc.poll() is not None for a in self.nodes.agents.values()), deadline,
                   "the agents to exit")
        self.end_unix = time.time()

    def _ready_for(self, fault: Fault) -> bool:
        self._pids = self.training_pids()
        if not self.both_training(self._pids):
            return False
        # a corrupt copy must be one a restore would read: every node holds a committed one
        return fault.kind != "fast-copy-corrupt" or all(newest_copy(self.fast_dir(node)) for node in (0, 1))

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            for launched in self.launches:
                launched.track()
            if self.nodes.agents[0].proc.poll() is not None and "exit" not in what:
                raise AssertionError(f"agent 0 exited (code {self.nodes.agents[0].proc.returncode}) before {what}\n"
                                     + self.output()[-6000:])
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n" + self.output()[-6000:])
            time.sleep(0.1)

    def _apply(self, fault: Fault, deadline: float) -> Applied:
        done = Applied(fault, began_unix=time.time())
        pids = self._pids  # both ranks', as _ready_for saw them
        victim = pids[fault.rank]
        if fault.kind == "worker-sigkill":
            os.kill(victim, signal.SIGKILL)
            done.pids = [victim]
        elif fault.kind == "worker-sigstop":
            os.kill(victim, signal.SIGSTOP)  # the peer's watchdog SIGKILLs it (same host); SIGCONT is never needed
            done.pids = [victim]
        elif fault.kind in ("agent-sigterm", "node-loss"):
            agent = self.nodes.agents[1]
            done.pids = [agent.proc.pid]
            if fault.kind == "agent-sigterm":
                self.nodes.signal(1, signal.SIGTERM)
            else:
                self.nodes.kill(1)
            self._wait(lambda: agent.proc.poll() is not None, deadline, "agent 1 to exit")
            time.sleep(max(0.0, done.began_unix + fault.duration_s - time.time()))
            self._launch(1)
        elif fault.kind == "s3-pause":
            done.pids = [self.s3.proc.pid]
            with self.s3.paused():
                time.sleep(fault.duration_s)
        elif fault.kind == "fast-copy-corrupt":
            for pid in pids.values():  # hold the job: no newer copy may land between the corruption and the kill
                os.kill(pid, signal.SIGSTOP)
            time.sleep(0.2)
            done.note = "; ".join(filter(None, (corrupt_newest(self.fast_dir(node)) for node in (0, 1))))
            os.kill(victim, signal.SIGKILL)
            for pid in pids.values():
                if pid != victim:
                    os.kill(pid, signal.SIGCONT)
            done.pids = [victim]
        elif fault.kind == "local-tier-full":
            filler = self.fast_dir(0) / "filler"
            done.note = f"filled {fill(filler)} bytes"
            time.sleep(fault.duration_s)
            filler.unlink()
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        done.ended_unix = time.time()
        return done

    # --- afterwards ---

    def stop(self) -> None:
        """SIGKILL whatever of the job is still alive (every launch of every agent), unmount the tmpfs."""
        if self.s3.proc is not None:
            os.kill(self.s3.proc.pid, signal.SIGCONT)
        for launched in self.launches:
            launched.kill_all()
        for node in (0, 1):
            if self.fast_dir(node).is_mount():
                subprocess.run(["umount", str(self.fast_dir(node))], check=False)

    def leftovers(self) -> list[str]:
        """What the job left behind: live processes, warm-start servers, listening sockets, files in /dev/shm."""
        found = [f"pid {pid} alive" for launched in self.launches for pid in launched.leftover_pids()]
        for launched in self.launches:
            prefix = server_prefix(launched.proc.pid)
            alive = procs.still_running(lambda: procs.warm_servers(launched.proc.pid), SERVER_EXIT_S)
            found += [f"warm-start server pid {pid} alive" for pid in alive]
            found += [f"socket file {path}" for path in Path(prefix).parent.glob(Path(prefix).name + "*")]
        port = int(self.nodes.endpoint.rsplit(":", 1)[1])
        if port in listening_ports():
            found.append(f"rendezvous port {port} still listening")
        found += [f"/dev/shm/{name} left" for name in sorted(set(os.listdir("/dev/shm")) - self.shm_before)]
        return found


STEP_LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) \[elastictrain r0 a\d+\] INFO step (\d+) epoch", re.MULTILINE)


def newest_copy(fast_dir: Path) -> Path | None:
    """The newest committed fast copy under ``fast_dir`` (its manifest is there), if any."""
    manifests = sorted(fast_dir.rglob(f"step-*/{MANIFEST_NAME}"), key=lambda p: p.parent.name)
    return manifests[-1].parent if manifests else None


def corrupt_newest(fast_dir: Path) -> str:
    """Flip bytes in the largest object of the newest committed fast copy under ``fast_dir``; say which."""
    snapshot = newest_copy(fast_dir)
    if snapshot is None:
        return ""
    target = max((p for p in snapshot.rglob("*") if p.is_file() and not p.name.startswith("MANIFEST")),
                 key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    target.write_bytes(bytes(data))
    return f"flipped 8 bytes of {target}"


def fill(path: Path) -> int:
    """Write zeros to ``path`` until its filesystem is full; the bytes written."""
    written = 0
    with path.open("wb", buffering=0) as sink:
        for size in (1 << 20, 1 << 16, 1 << 12, 1):  # down to the last byte: a small snapshot must not fit either
            try:
                while True:
                    written += sink.write(b"\0" * size)
            except OSError:
                continue
    return written


def listening_ports() -> set[int]:
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# --- what the log says ---

# For each kind, the lines that show it happened and was dealt with (each must appear once per fault at least).
VISIBLE = {
    "worker-sigkill": re.compile(r"failed \(exitcode: -9\)"),
    "worker-sigstop": re.compile(r"heartbeat has not changed for"),
    "agent-sigterm": re.compile(r"preempted at step \d+: snapshot committed"),
    "node-loss": re.compile(r"world size 2 -> 1: 2 virtual shards"),
    # (its "caught up" line comes only if the writer lives to the next commit: often a later fault kills it first)
    "s3-pause": re.compile(r"snapshot at step \d+ not committed \(snapshot s3://"),
    "fast-copy-corrupt": re.compile(r"skipping snapshot \S*fast-node\d\S*: "),
    "local-tier-full": re.compile(r"WARNING .*fast-node0.*(?:full|No space)"),
    "nan-batch": re.compile(r"step \d+ replayed clean: the anomaly"),
}


def visible_counts(output: str) -> dict[str, int]:
    return {kind: len(pattern.findall(output)) for kind, pattern in VISIBLE.items()}


def not_visible(output: str, faults: list[Fault]) -> list[str]:
    """The kinds whose faults the log shows fewer times than they happened."""
    counts = visible_counts(output)
    wanted: dict[str, int] = {}
    for fault in faults:
        wanted[fault.kind] = wanted.get(fault.kind, 0) + 1
    # a SIGKILLed worker, a frozen one (killed by its peer) and a corrupt copy's kill each end in one exit -9;
    # a lost node too
    wanted_kills = sum(wanted.get(k, 0) for k in ("worker-sigkill", "worker-sigstop", "fast-copy-corrupt"))
    missing = []
    for kind, count in wanted.items():
        need = wanted_kills if kind == "worker-sigkill" else count
        if counts[kind] < need:
            missing.append(f"{kind}: {count} fault(s), the log shows {counts[kind]} (`{VISIBLE[kind].pattern}`)")
    return missing


def step_times(output: str, day: datetime.date) -> list[tuple[float, int]]:
    """(unix s, step) of rank 0's step lines, in log order (local time of ``day``)."""
    found = []
    for hours, minutes, seconds, millis, step in STEP_LINE.findall(output):
        moment = datetime.datetime.combine(day, datetime.time(int(hours), int(minutes), int(seconds), int(millis) * 1000))
        found.append((moment.timestamp(), int(step)))
    return sorted(found)


def cost_of(applied: list[Applied], steps: list[tuple[float, int]]) -> list[dict]:
    """Per fault: steps redone and seconds lost.

    From the fault's start to the later of its end and the moment the job first trains beyond the step it had
    reached (the high-water mark), the time not spent on new steps is lost: that window less the new steps in it
    times the median step time of the whole job. Steps redone: the high-water mark less the lowest step after it.
    """
    intervals = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in zip(steps, steps[1:]) if s1 > s0]
    step_s = statistics.median(intervals) if intervals else 0.0
    costs = []
    for done in applied:
        before = [step for t, step in steps if t <= done.began_unix]
        high = max(before, default=0)
        after = [(t, step) for t, step in steps if t > done.began_unix]
        regained = next((t for t, step in after if step > high and t >= done.ended_unix), None)
        lowest = min((step for t, step in after if regained is None or t <= regained), default=high)
        end = regained if regained is not None else done.ended_unix
        new_steps = max((step for t, step in after if t <= end), default=high) - high
        costs.append({**asdict(done.fault), "began_s": round(done.began_unix, 3), "window_s": round(end - done.began_unix, 2),
                      "steps_redone": max(0, high - lowest),
                      "seconds_lost": round(max(0.0, end - done.began_unix - new_steps * step_s), 2),
                      "pids": done.pids, "note": done.note})
    return costs


def goodput_by_cause(durable_url: str, storage_options: dict) -> dict:
    """The goodput counters the final durable snapshot holds (rank 0's, across every attempt)."""
    _, objects = SnapshotStore(durable_url, storage_options).latest_valid()
    return load_object(objects["state.pt"], "final")["goodput"]


def table(costs: list[dict], visible: dict[str, int]) -> str:
    """One table: faults by kind, survived, steps redone, seconds lost."""
    lines = ["| fault | count | survived | seen in the log | steps redone | seconds lost |", "|---|---|---|---|---|---|"]
    for kind in KINDS:
        of_kind = [c for c in costs if c["kind"] == kind]
        if not of_kind:
            continue
        lines.append(f"| {kind} | {len(of_kind)} | {sum(c.get('survived', True) for c in of_kind)} | {visible[kind]} "
                     f"| {sum(c['steps_redone'] for c in of_kind)} | {sum(c['seconds_lost'] for c in of_kind):.1f} |")
    return "\n".join(lines)


def unbroken_command(workdir: Path, steps: int) -> list[str]:
    """The same training, one torchrun, two workers, no faults and no snapshots: what the chaos run must equal."""
    from tests.conftest import torchrun_command

    (workdir / "trace").mkdir(parents=True, exist_ok=True)
    return torchrun_command([*TRAIN, f"train.max_steps={steps}", f"run.dir={workdir / 'run'}",
                             f"task.args.trace_dir={workdir / 'trace'}", "snapshot.durable.every_steps=0",
                             "snapshot.durable.on_done=false"])

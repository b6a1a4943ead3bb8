"""A real one-node SLURM cluster for tests: munged, slurmctld and slurmd on this machine.

Debian's packages (``slurmctld``, ``slurmd``, ``slurm-client``, ``munge``) are installed on
first use when missing (root and apt needed; otherwise the caller skips with the reason). The
cluster lives in a temporary directory: slurm.conf, state, spool, logs, and munged's socket,
so it touches no system service and any number of test sessions can run side by side. Every
daemon runs in the foreground as our child, is stopped by pid and reaped.

Processes started by slurmd (slurmstepd, job scripts, tasks) are not our children: slurmd
daemonizes them. They all inherit ``SLURM_CONF=<this cluster's slurm.conf>`` in their
environment, which is how ``stop()`` finds and kills whatever a job left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import procs

APT_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
DAEMON_BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo"]
MUNGE_KEY = Path("/etc/munge/munge.key")
POLL_INTERVAL_S = 0.1
STOP_GRACE_S = 10.0
FINISHED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(Exception):
    """SLURM cannot be installed or started here; the message says why (tests skip with it)."""


def _which(binary: str) -> str | None:
    return shutil.which(binary) or next(
        (str(p) for p in (Path("/usr/sbin") / binary, Path("/usr/bin") / binary) if p.exists()), None
    )


def ensure_installed() -> float:
    """Install Debian's SLURM and munge packages if any binary is missing; return the seconds it took (0 if present)."""
    if all(_which(binary) for binary in DAEMON_BINARIES):
        return 0.0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurmctld/slurmd/munged are not installed and this is not root with apt-get to install them")
    started = time.monotonic()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # man-db's trigger re-indexes every man page after the install (minutes on a slow disk);
    # Debian's own switch turns it off for this and later installs.
    subprocess.run(["debconf-set-selections"], input="man-db man-db/auto-update boolean false\n", text=True, env=env, capture_output=True)
    Path("/var/lib/man-db/auto-update").unlink(missing_ok=True)
    for step in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        run = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(step)}` failed with exit code {run.returncode}: {run.stderr.strip()[-500:]}")
    missing = [binary for binary in DAEMON_BINARIES if not _which(binary)]
    if missing:
        raise SlurmUnavailable(f"installed {APT_PACKAGES} but {missing} are still missing")
    return time.monotonic() - started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Job:
    job_id: int
    output_path: Path

    def output(self) -> str:
        try:
            return self.output_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


@dataclass
class SlurmCluster:
    """One node (this host, CPUs=cpus) in one partition; ``start()``, submit jobs, ``stop()``."""

    root: Path
    cpus: int = 2
    hostname: str = field(default_factory=socket.gethostname)
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    # munged runs as the munge user, who cannot enter pytest's 0700 temp tree: its socket, pid
    # and seed live in a directory of their own directly under /tmp.
    munge_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elastictrain-munge-")))

    @property
    def conf_path(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.munge_dir / "munge.socket"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment for SLURM commands (and, through sbatch, for jobs) of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf_path), **(extra or {})}

    def write_config(self) -> None:
        for sub in ("etc", "state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(
            "\n".join([
                "ClusterName=elastictrain-test",
                f"SlurmctldHost={self.hostname}",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket}",
                f"StateSaveLocation={self.root / 'state'}",
                f"SlurmdSpoolDir={self.root / 'spool'}",
                f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                f"SlurmdPidFile={self.root / 'slurmd.pid'}",
                f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "AccountingStorageType=accounting_storage/none",
                "JobAcctGatherType=jobacct_gather/none",
                "JobCompType=jobcomp/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerType=sched/builtin",
                # Preempted jobs: TERM first, KILL after KillWait.
                "KillWait=30",
                "MinJobAge=300",
                # Not requeueable unless the job asks (#SBATCH --requeue), as on many sites.
                "JobRequeue=0",
                # The machine's memory, as sites declare it: the templates ask for some (#SBATCH --mem).
                f"NodeName={self.hostname} CPUs={self.cpus} RealMemory={_memory_mb()} State=UNKNOWN",
                f"PartitionName=test Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP",
                "",
            ])
        )

    def _start_daemon(self, name: str, args: list[str], **popen_args) -> None:
        log_file = open(self.root / "log" / f"{name}.stdout", "wb")
        with log_file:
            self.daemons[name] = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=self.env(), start_new_session=True, **popen_args,
            )

    def start(self, timeout_s: float = 60.0) -> float:
        """Start munged, slurmctld and slurmd; return the seconds until the node accepts jobs."""
        started = time.monotonic()
        self.write_config()
        if not MUNGE_KEY.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True, user="munge", group="munge")
        munge_dir = self.munge_dir
        shutil.chown(munge_dir, "munge", "munge")
        munge_dir.chmod(0o755)  # clients (sbatch, slurmctld) must reach the socket
        self._start_daemon("munged", [
            _which("munged"), "--foreground", f"--socket={self.munge_socket}",
            f"--pid-file={munge_dir / 'munged.pid'}", f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ], user="munge", group="munge")
        self._wait(lambda: self.munge_socket.exists(), timeout_s, "munged's socket")
        self._start_daemon("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf_path)])
        self._start_daemon("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf_path)])
        self._wait(lambda: self._node_state() == "idle", timeout_s, "node idle in sinfo")
        return time.monotonic() - started

    def _node_state(self) -> str:
        run = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = {name: proc.returncode for name, proc in self.daemons.items() if proc.poll() is not None}
            if dead or time.monotonic() > deadline:
                reason = f"{dead} exited" if dead else f"not ready after {timeout_s} s"
                raise SlurmUnavailable(f"SLURM cluster in {self.root}: waiting for {what}: {reason}\n{self.logs()}")
            time.sleep(POLL_INTERVAL_S)

    def logs(self, lines: int = 30) -> str:
        texts = []
        for path in sorted((self.root / "log").glob("*")) + [self.munge_dir / "munged.log"]:
            if path.exists():
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
                texts.append(f"--- {path.name} ---\n{tail}")
        return "\n".join(texts)

    def sbatch(self, script: Path, args: list[str] = (), *, options: list[str] = (), env: dict[str, str] | None = None,
               output_path: Path) -> Job:
        """Submit script with its args; options go before the script and override its #SBATCH lines."""
        run = subprocess.run(
            ["sbatch", "--parsable", f"--output={output_path}", *options, str(script), *args],
            env=self.env(env), capture_output=True, text=True, timeout=60,
        )
        if run.returncode != 0:
            raise AssertionError(f"sbatch {script} failed ({run.returncode}): {run.stderr.strip()}")
        return Job(int(run.stdout.strip().split(";")[0]), output_path)

    def job_info(self, job: Job) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, RunTime, ...)."""
        run = subprocess.run(["scontrol", "-o", "show", "job", str(job.job_id)], env=self.env(), capture_output=True, text=True)
        if run.returncode != 0:
            raise AssertionError(f"scontrol show job {job.job_id}: {run.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", run.stdout))

    def wait_job(self, job: Job, timeout_s: float, *, states: set[str] = FINISHED_STATES) -> dict[str, str]:
        """Wait until the job is in one of states; return its job_info. On timeout cancel it and fail."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job_info(job)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                self.scancel(job)
                raise AssertionError(
                    f"job {job.job_id} still {info.get('JobState')} after {timeout_s} s\n{job.output()[-3000:]}\n{self.logs()}"
                )
            time.sleep(POLL_INTERVAL_S)

    def wait_output(self, job: Job, pattern: str, timeout_s: float) -> re.Match:
        """Wait for a line matching pattern in the job's output file; fail if the job ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = re.search(pattern, job.output(), re.MULTILINE)
            if found:
                return found
            state = self.job_info(job).get("JobState")
            if state in FINISHED_STATES or time.monotonic() > deadline:
                raise AssertionError(f"job {job.job_id} ({state}): no line matching {pattern!r}\n{job.output()[-3000:]}")
            time.sleep(POLL_INTERVAL_S / 2)

    def start_requeued_now(self, job: Job, timeout_s: float) -> None:
        """Wait for the job to be back in the queue after a requeue, then make it eligible at once.

        SLURM holds a requeued job (Reason=BeginTime) for about 120 s before it may start
        again (measured on 22.05); an administrator's `scontrol update StartTime=now` skips
        that, once the old attempt has left the node.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job_info(job)
            if info.get("JobState") == "PENDING" and int(info.get("Restarts", "0")) >= 1:
                break
            if info.get("JobState") in FINISHED_STATES or time.monotonic() > deadline:
                raise AssertionError(f"job {job.job_id} was not requeued: {info.get('JobState')} Restarts={info.get('Restarts')}\n{job.output()[-3000:]}")
            time.sleep(POLL_INTERVAL_S)
        # The old attempt must be gone from the node, and the new credential must be newer
        # than the revocation of the old one: slurmd compares the two in whole seconds, and a
        # launch within the same second is killed ("Job credential revoked").
        self._wait(lambda: self._node_state() == "idle", timeout_s, "the node idle after the requeue")
        time.sleep(1.1)
        run = subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], env=self.env(), capture_output=True, text=True)
        if run.returncode != 0:
            raise AssertionError(f"scontrol update JobId={job.job_id} StartTime=now: {run.stderr.strip()}")

    def scancel(self, job: Job, *options: str) -> None:
        subprocess.run(["scancel", *options, str(job.job_id)], env=self.env(), capture_output=True, timeout=30)

    def cluster_pids(self) -> list[int]:
        """Live processes carrying this cluster's SLURM_CONF in their environment (daemons, steps, tasks)."""
        marker = f"SLURM_CONF={self.conf_path}".encode()
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit() and int(name) != os.getpid()]
        return sorted(pid for pid in pids if marker in procs.environ(pid) and procs.pid_alive(pid))

    def stop(self) -> list[int]:
        """Cancel all jobs, stop the daemons by pid, reap them, kill any job process left; return pids that survived."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--partition=test"], env=self.env(), capture_output=True, timeout=30)
            subprocess.run(["scancel", "--partition=test"], env=self.env(), capture_output=True, timeout=30)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.daemons.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in self.cluster_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while self.cluster_pids() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        return self.cluster_pids()


def _memory_mb() -> int:
    """This machine's memory in MB (MemTotal of /proc/meminfo), for the node's RealMemory."""
    kilobytes = int(re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M).group(1))
    return kilobytes // 1024

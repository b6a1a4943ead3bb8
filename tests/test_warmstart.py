"""Warm restarts (elastictrain/launcher/warmstart.py): restarted workers forked from a preloaded interpreter.

Under real torchrun, one job meets every way a warm worker can end, each at a known step (the
test task pauses there): a SIGKILL of the cold first worker, a SIGKILL of a warm child itself, a
SIGTERM to a client (forwarded: the ranks stop with a snapshot) and a SIGKILL of a client (its
child must die with it). The job must end bitwise equal to the unbroken reference run having
trained every sample exactly once, and the preloaded interpreter must be gone once the agent is.
The parts outside torchrun (arguments, exit statuses, the cold path) are tested on their own.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from elastictrain.launcher.warmstart import DEFAULT_PRELOAD, Target, fork_hazard, parse, server_prefix
from tests.conftest import REPO_ROOT, job_env, parse_job
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps
from tests.helpers.tasks import read_traces, stitch

WARM = re.compile(r"elastictrain\.launcher\.warmstart: started warm, forked from the preloaded interpreter \(pid (\d+)\)")
PREEMPTED = re.compile(r"preempted at step (\d+): snapshot committed, exiting with code 143")


@pytest.mark.parametrize("argv, expected", [
    (["train.py", "--lr", "0.1"], Target(None, "train.py", ("--lr", "0.1"), DEFAULT_PRELOAD)),
    (["-m", "elastictrain", "train", "x=1"], Target("elastictrain", None, ("train", "x=1"), DEFAULT_PRELOAD)),
    (["--preload", "numpy,transformers", "t.py"], Target(None, "t.py", (), (*DEFAULT_PRELOAD, "numpy", "transformers"))),
    (["--preload=numpy", "-m", "pkg.main"], Target("pkg.main", None, (), (*DEFAULT_PRELOAD, "numpy"))),
    ([], None),
    (["-m"], None),
    (["--lr", "0.1"], None),
])
def test_arguments_are_read_as_python_reads_a_script_or_module(argv, expected):
    assert parse(argv) == expected


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", code, *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})


@pytest.mark.slow
@pytest.mark.parametrize("status, returncode", [
    (0, 0), (3 << 8, 3), (143 << 8, 143),  # exit codes
    (signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, -signal.SIGTERM), (signal.SIGUSR1, -signal.SIGUSR1),
])
def test_the_client_ends_as_its_child_ended(status, returncode):
    # What torchrun sees of a warm worker is the client: a child's exit code or signal must reach it unchanged.
    ended = run_python(f"from elastictrain.launcher.warm_client import exit_like; exit_like({int(status)})")
    assert ended.returncode == returncode, ended.stderr


@pytest.mark.slow
def test_no_script_is_one_line_and_exit_2():
    ended = run_python("", "-m", "elastictrain.launcher.warmstart", "--preload", "numpy")
    assert ended.returncode == 2
    assert ended.stderr.count("\n") == 1 and "give the script to run (or -m MODULE)" in ended.stderr


@pytest.mark.slow
def test_outside_torchrun_the_script_runs_cold_with_its_arguments_and_exit_code(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:], 'file', __file__)\nsys.exit(7)\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHELASTIC")}
    ended = subprocess.run([sys.executable, "-m", "elastictrain.launcher.warmstart", str(script), "a", "--b"],
                           capture_output=True, text=True, timeout=60, env={**env, "PYTHONPATH": str(REPO_ROOT)})
    assert ended.returncode == 7, ended.stderr
    assert f"argv ['a', '--b'] file {script}" in ended.stdout
    assert "warm" not in ended.stderr


# A module that initialises CUDA when it is imported. Without a GPU, torch's flag is set as torch.cuda.init() sets it:
# what the guard reads (torch.cuda.is_initialized()); on a GPU machine CUDA is initialised for real.
CUDA_PRELOAD = """import torch
if torch.cuda.is_available():
    torch.cuda.init()
else:
    torch.cuda._initialized = True
"""


@pytest.mark.parametrize("threads, cuda_context, hazard", [
    (0, False, None),
    (2, False, "the preloaded modules started threads (2): a fork of them is unsafe"),
    (0, True, "a preloaded module initialised CUDA: a forked worker could not use the GPU"),
    (3, True, "a preloaded module initialised CUDA: a forked worker could not use the GPU"),  # CUDA's own threads too
])
def test_a_fork_is_refused_with_threads_running_or_a_cuda_context(threads, cuda_context, hazard):
    assert fork_hazard(threads, cuda_context) == hazard


SERVER_WITH_CUDA = """
import os, socket, sys, threading, time
import torch
from elastictrain.launcher import warm_server
from elastictrain.launcher.warm_protocol import receive_message, send_message

torch.cuda._initialized = True  # CUDA initialised in the server after it was forked (a bug): it must fork no worker
agent_read, agent_write = os.pipe()
base = sys.argv[1]
threading.Thread(target=warm_server.serve, args=(base, os.open(os.devnull, os.O_RDONLY), agent_read), daemon=True).start()
while not os.path.exists(base + ".sock"):
    time.sleep(0.01)
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
client.connect(base + ".sock")
send_message(client, {"module": "json.tool", "script": None, "args": [], "cwd": "/", "env": {}, "streams": {},
                      "client_started": 0.0}, [0, 1, 2])
reply, _ = receive_message(client)
try:
    os.waitpid(-1, os.WNOHANG)
    children = "a child"
except ChildProcessError:
    children = "no child"
os.write(1, (repr(reply) + " / " + children).encode())
os.write(agent_write, b"x")  # the agent is gone: the server returns
"""


@pytest.mark.slow
def test_a_server_holding_a_cuda_context_forks_no_worker_and_tells_the_client_to_run_cold(tmp_path):
    done = subprocess.run([sys.executable, "-c", SERVER_WITH_CUDA, str(tmp_path / "warm")], capture_output=True,
                          text=True, env=job_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "{'cold': 'it holds a CUDA context, which a forked worker could not use'} / no child"


@pytest.mark.slow
@pytest.mark.parametrize("preloaded, local_rank, said", [
    ("threaded_preload", "0", "the preloaded modules started threads (1): a fork of them is unsafe; restarts run cold"),
    ("cuda_preload", "0", "a preloaded module initialised CUDA: a forked worker could not use the GPU; restarts run cold"),
    ("missing_preload", "0", "preloading missing_preload failed (ModuleNotFoundError: No module named "
                             "'missing_preload'); restarts run cold"),
    ("threaded_preload", "1", "this start runs cold: local rank 0 forks the preloaded interpreter"),
])
def test_a_preload_that_fails_or_starts_a_thread_forks_no_server_and_the_script_runs_as_it_would_have(
        tmp_path, preloaded, local_rank, said):
    # Under torchrun's environment with no server yet, local rank 0 takes the lock and preloads; a module
    # that starts a thread makes a fork unsafe, one that fails makes it pointless: one line, and no server.
    # Another local rank neither preloads nor waits: it starts cold at once.
    (tmp_path / "threaded_preload.py").write_text("import threading, time\n"
                                                  "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    (tmp_path / "cuda_preload.py").write_text(CUDA_PRELOAD)
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint('argv', sys.argv[1:], 'name', __name__)\nsys.exit(5)\n")
    env = {**job_env(), "TORCHELASTIC_RUN_ID": "preload-test", "LOCAL_RANK": local_rank, "XDG_RUNTIME_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)])}
    ended = subprocess.run([sys.executable, "-m", "elastictrain.launcher.warmstart", "--preload", f"json,{preloaded}",
                            str(script), "a"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert ended.returncode == 5, ended.stderr
    assert ended.stdout == "argv ['a'] name __main__\n"
    assert ended.stderr == f"elastictrain.launcher.warmstart: {said}\n"
    assert procs.warm_server_pids(os.getpid()) == [] and not glob.glob(str(tmp_path / "elastictrain-warm-*"))


def wait_gone(pid: int, timeout_s: float = 10.0) -> float:
    started = time.monotonic()
    while procs.pid_alive(pid):
        assert time.monotonic() - started < timeout_s, f"pid {pid} still alive after {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.torchrun
def test_every_way_a_warm_worker_ends_restarts_warm_and_the_run_stays_bitwise(tmp_path, reference_run):
    # Pauses at per-process training calls, so each fires in the attempt named (once per job):
    # attempt 0 (cold) rank 1 at call 30 = step 30; attempt 1 (from step 25) rank 0 at call 40 =
    # step 65; attempt 2 (from 50) rank 1 at call 50 = step 100; attempt 3 (from the preemption
    # snapshot, a few steps later) rank 0 at call 80.
    pauses = "[[1,30],[0,40],[1,50],[0,80]]"
    job = launch_job(tmp_path, "job", [f"task.args.pauses={pauses}"], max_restarts=4, warmstart=True)
    marker = lambda rank, call: tmp_path / "trace" / f"paused-rank{rank}-call{call}.pid"  # noqa: E731

    cold = int(procs.wait_for_file(marker(1, 30), TIMEOUT_S, job))
    seen_servers = set(procs.warm_server_pids(job.proc.pid))
    assert cold == procs.torchrun_worker(job.proc.pid, 1), "the first attempt runs cold: the worker is torchrun's"
    os.kill(cold, signal.SIGKILL)

    warm_child = int(procs.wait_for_file(marker(0, 40), TIMEOUT_S, job))
    assert warm_child != procs.torchrun_worker(job.proc.pid, 0), "a restarted worker: a child of the preloaded one"
    os.kill(warm_child, signal.SIGKILL)  # its client must end as it did: torchrun sees -9

    paused = int(procs.wait_for_file(marker(1, 50), TIMEOUT_S, job))
    os.kill(procs.torchrun_worker(job.proc.pid, 1), signal.SIGTERM)  # forwarded to the child: a preemption
    marker(1, 50).with_suffix(".resume").touch()

    last_child = int(procs.wait_for_file(marker(0, 80), TIMEOUT_S, job))
    os.kill(procs.torchrun_worker(job.proc.pid, 0), signal.SIGKILL)
    print(f"child gone {wait_gone(last_child):.2f} s after its client's SIGKILL")

    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    servers = {int(pid) for pid in WARM.findall(output)}
    assert len(WARM.findall(output)) == 8 and len(servers) == 1, "attempts 1-4 of both ranks start warm from one server"
    assert output.count("forked a preloaded interpreter from itself") == 1, "one first-attempt worker forked the server"
    assert seen_servers == servers, "the server names itself in its lock file"
    assert "rank 1 received SIGTERM at step 100" in output
    pinned = re.findall(r"threads pinned for bitwise results: (.*) \(count: ", output)  # probed in each child after
    assert len(pinned) == 5 and len(set(pinned)) == 1, pinned  # the server's warm-up: the runtime of the cold start
    stopped = int(PREEMPTED.search(output).group(1))
    assert output.count("(exitcode: -9)") == 3 and output.count("(exitcode: 143)") == 1
    steps = start_steps(output)
    assert steps[:4] == [0, 25, 50, stopped] and steps[4] == (stopped + 79) // 25 * 25, steps
    result = parse_job(output)
    assert result.summary["params_sha256"] == reference_run.result.summary["params_sha256"]
    for rank in (0, 1):
        assert stitch(read_traces(tmp_path / "trace", rank), steps) == reference_run.traces[rank]
    assert paused != last_child
    wait_gone(servers.pop(), timeout_s=5.0)  # the preloaded interpreter leaves with its agent
    assert not glob.glob(server_prefix(job.proc.pid) + "*")


@pytest.mark.slow
def test_help_prints_usage_and_a_missing_script_says_so_once():
    """`python -m elastictrain.launcher.warmstart --help`: usage on stdout, exit 0; with no script: one line, exit 2."""
    command = [sys.executable, "-m", "elastictrain.launcher.warmstart"]
    shown = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=60, env={**os.environ, **job_env()})
    assert (shown.returncode, shown.stderr) == (0, ""), shown.stderr
    assert shown.stdout.startswith("usage: torchrun ... -m elastictrain.launcher.warmstart [--preload a,b] (SCRIPT | -m MODULE)")
    missing = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, **job_env()})
    assert missing.returncode == 2
    assert missing.stderr.count("elastictrain.launcher.warmstart:") == 1, missing.stderr
    assert missing.stderr.startswith("elastictrain.launcher.warmstart: give the script to run"), missing.stderr


PRELOAD = '''
import sys
from elastictrain.core import threads
from elastictrain.launcher import warmstart

threads.warm_up = lambda: print("warmed up with", sorted(m for m in ("torch", "json") if m in sys.modules), flush=True)
print("preloaded:", warmstart.preload(tuple(sys.argv[1].split(","))), flush=True)
'''


@pytest.mark.slow
@pytest.mark.parametrize("preload, lines", [
    ("torch", ["warmed up with ['json', 'torch']", "preloaded: True"]),
    ("json", ["preloaded: True"]),
    ("json,no_such_module_here", ["preloaded: False"]),
])
def test_the_preload_warms_up_mkls_report_once_torch_is_imported_and_a_failed_import_says_so(preload, lines):
    # MKL's first verbose report times the CPU's clock (0.3-0.7 s): a server forked after it reports at once.
    done = subprocess.run([sys.executable, "-c", PRELOAD, preload], capture_output=True, text=True, env=job_env(),
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == lines
    failed = ["elastictrain.launcher.warmstart: preloading no_such_module_here failed (ModuleNotFoundError: "
              "No module named 'no_such_module_here'); restarts run cold"]
    assert done.stderr.splitlines() == (failed if "no_such" in preload else [])

"""A worker that lost a peer leaves at once: its line said, its output flushed, no finalization.

From a script (``Trainer.fit()`` called by the user's code), the same holds when the launcher's
SIGTERM came first and was held for a preemption snapshot: once the group is found broken, the
signal takes its default course as soon as ``fit()`` has cleaned up, before the process group's teardown (which,
with a dead peer, waits about 0.35 s on its gloo pairs while torchrun waits for this process).

``python -m elastictrain train`` is run in a subprocess whose training raises what ``fit()``
raises when a collective breaks (``PeerLost``). An atexit handler stands for the interpreter's
finalization, which with torch loaded took about 1 s here while torchrun waited for it
(``benchmarks/recovery.py``'s stop column). The other errors keep a normal exit.

Every other end of the program (``cli.run``: the console script and ``python -m elastictrain``) skips
the interpreter's finalization too, after doing what of it matters: the program's non-daemon threads
joined, the atexit handlers run, the streams flushed (``benchmarks/exit_time.py`` measures it), a bug
its session logged with its traceback included; only a bug no session saw leaves the normal way.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT, job_env

WORKER = textwrap.dedent('''
    import atexit, sys
    from elastictrain.cli import main as cli
    from elastictrain.core import errors

    marker, error = sys.argv[1], sys.argv[2]

    def train(config_path, overrides):
        print("step 7 trained", end="\\n")  # block-buffered: stdout is a pipe
        raise getattr(errors, error)("rank 0 lost a peer in state TRAIN at step 7 (Connection closed by peer); "
                                     "the launcher restarts the group from the newest snapshot")

    cli._train = train
    atexit.register(lambda: open(marker, "w").write("finalized"))
    sys.exit(cli.main(["train"]))
''')


def run_worker(tmp_path, error: str) -> tuple[subprocess.CompletedProcess, bool]:
    marker = tmp_path / "finalized"
    done = subprocess.run([sys.executable, "-c", WORKER, str(marker), error], capture_output=True, text=True,
                          env=job_env(), cwd=REPO_ROOT, timeout=60)
    return done, marker.exists()


@pytest.mark.slow
def test_a_rank_that_lost_a_peer_says_so_flushes_and_leaves_without_finalizing(tmp_path):
    done, finalized = run_worker(tmp_path, "PeerLost")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "elastictrain: error: rank 0 lost a peer in state TRAIN at step 7 (Connection closed by peer); "
        "the launcher restarts the group from the newest snapshot"
    ]
    assert done.stdout == "step 7 trained\n"
    assert not finalized


@pytest.mark.slow
@pytest.mark.parametrize("error", ["SnapshotError", "StorageError"])
def test_other_errors_end_the_interpreter_as_usual(tmp_path, error):
    done, finalized = run_worker(tmp_path, error)
    assert done.returncode == 1 and done.stdout == "step 7 trained\n"
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("elastictrain: error: ")
    assert finalized


SCRIPT = textwrap.dedent('''
    import atexit, os, signal, sys
    from elastictrain import Trainer, seed_everything
    from elastictrain.dist import group as dist
    from tests.helpers.tasks import build

    marker, trace_dir, signalled = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    teardown = dist.teardown
    def recorded_teardown(ctx):  # a broken gloo group's teardown waits ~0.35 s on the dead peer's pairs
        open(marker + "-teardown", "w").write("ran")
        teardown(ctx)
    dist.teardown = recorded_teardown
    seed_everything(0)
    task = build(trace_dir, train_samples=256, hidden=16)

    def loss_fn(model, batch):
        if signalled:
            os.kill(os.getpid(), signal.SIGTERM)  # the launcher's SIGTERM: held for a preemption snapshot
        raise RuntimeError("[/gloo/transport/tcp/pair.cc:537] Connection closed by peer [127.0.0.1]:4242")

    atexit.register(lambda: open(marker, "w").write("finalized"))
    print("before fit", flush=False)
    Trainer(task.model, task.optimizer, task.train_data, loss_fn,
            config={"run": {"dir": trace_dir}, "log": {"progress_bar": False, "plots": False}}).fit()
''')


@pytest.mark.slow
@pytest.mark.parametrize("signalled", [True, False], ids=["sigterm-held", "no-signal"])
def test_a_script_whose_group_broke_ends_by_the_held_sigterm_at_once(tmp_path, signalled):
    marker = tmp_path / "finalized"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), str(tmp_path), "1" if signalled else "0"],
                          capture_output=True, text=True, env=job_env(), cwd=REPO_ROOT, timeout=120)
    assert "lost a peer in state TRAIN at step 0" in done.stderr, done.stderr[-3000:]
    assert done.stdout == "before fit\n"
    if signalled:
        assert done.returncode == -signal.SIGTERM, done.stderr[-3000:]
        assert not marker.exists(), "the held SIGTERM should end the process before the interpreter's finalization"
        assert not (tmp_path / "finalized-teardown").exists(), "and before the process group's teardown"
    else:  # nothing held: the exception ends the script as any exception would
        assert done.returncode == 1
        assert marker.exists() and (tmp_path / "finalized-teardown").exists()


PROGRAM = textwrap.dedent('''
    import atexit, concurrent.futures, sys, threading, time
    from elastictrain.cli import main as cli

    directory, ending = sys.argv[1], sys.argv[2]

    class Finalized:  # deleted when the interpreter tears __main__ down at its finalization
        def __del__(self, open=open, path=directory + "/module-teardown"):  # builtins may be gone by then
            open(path, "w").write("ran")

    kept = Finalized()
    pools = []

    def train(config_path, overrides):
        print("trained", end="\\n")  # block-buffered: stdout is a pipe
        def late():
            time.sleep(0.5)
            open(directory + "/thread", "w").write("joined")
        threading.Thread(target=late).start()  # a non-daemon thread the task left running
        pools.append(concurrent.futures.ThreadPoolExecutor(1))  # and an executor kept but never shut down:
        pools[-1].submit(print, end="")  # its idle worker waits until the interpreter's threading hooks stop it
        if ending == "preempted":
            raise SystemExit(143)
        if ending == "bug":
            raise KeyError("a bug")
        if ending == "bug in a session":  # its session logs the traceback as the rank's failure (failures.py)
            from elastictrain.train.session import Session

            config = {"run": {"dir": directory + "/run"}, "log": {"progress_bar": False, "plots": False}}
            with Session(config):
                raise KeyError("a bug in the loop")
        return 0

    cli._train = train
    atexit.register(lambda: open(directory + "/atexit", "w").write("ran"))
    sys.argv = ["elastictrain", "train"]
    try:
        cli.run()
    finally:  # an exception that left run(): the interpreter's own way out, its finalization after
        open(directory + "/unwound", "w").write("ran")
''')


@pytest.mark.slow
@pytest.mark.parametrize("ending,code", [("done", 0), ("preempted", 143)])
def test_the_program_ends_without_finalization_after_joining_threads_and_running_atexit(tmp_path, ending, code):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), ending], capture_output=True, text=True,
                          env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert done.returncode == code, done.stderr[-3000:]
    assert done.stdout == "trained\n" and done.stderr == ""
    assert (tmp_path / "thread").read_text() == "joined", "a non-daemon thread is waited for, as the interpreter does"
    assert (tmp_path / "atexit").read_text() == "ran", "the atexit handlers run, as at the interpreter's finalization"
    assert not (tmp_path / "module-teardown").exists(), "the interpreter's module teardown was skipped"
    assert not (tmp_path / "unwound").exists(), "the process ended inside run()"


@pytest.mark.slow
def test_a_bug_leaves_the_program_the_normal_way_with_its_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), "bug"], capture_output=True, text=True,
                          env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 1 and "Traceback" in done.stderr and "KeyError: 'a bug'" in done.stderr
    assert (tmp_path / "atexit").exists() and (tmp_path / "module-teardown").exists()
    assert (tmp_path / "unwound").exists()


@pytest.mark.slow
def test_a_bug_its_session_logged_ends_the_program_without_finalization_traceback_said_once(tmp_path):
    done = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path), "bug in a session"], capture_output=True,
                          text=True, env=job_env(), cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("Traceback") == 1 and done.stderr.count("KeyError: 'a bug in the loop'") == 1
    assert "failed in state" in done.stderr  # the session's line, above its traceback
    assert (tmp_path / "thread").read_text() == "joined" and (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "unwound").exists(), "the process ended inside run(), before the interpreter's finalization"


GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:54499. This is typically caused by a remote worker crashing, or by the remote worker being "
               "killed.")


@pytest.mark.parametrize("text, reason", [
    (GLOO_CLOSED, "Connection closed by peer [127.0.0.1]:54499."),  # before: "... caused by a remote worker )"
    ("Timed out waiting 1800000ms for send operation to complete", "Timed out waiting 1800000ms for send operation to complete"),
    ("word " * 40, "word " * 31 + "word ..."),  # cut at a word, and said to be cut
])
def test_a_lost_peer_s_reason_is_the_first_sentence_cut_at_a_word(text, reason):
    from elastictrain.dist.failures import peer_loss_reason

    assert peer_loss_reason(text) == reason


def test_a_peer_that_recorded_an_error_no_restart_can_fix_is_named_instead_of_a_restart():
    import json

    import torch.distributed as tdist

    from elastictrain.dist.group import FATAL_KEY, DistContext, recorded_fatal_error
    from elastictrain.launcher.launch_env import LaunchEnv

    store = tdist.HashStore()
    ctx = DistContext(LaunchEnv("torchrun"), True, None, "gloo", 60.0, store, "round-2")
    assert recorded_fatal_error(ctx) is None
    store.set(FATAL_KEY, json.dumps({"restart": 0, "round": "round-1", "rank": 0, "exit_code": 2, "kind": "UsageError"}))
    assert recorded_fatal_error(ctx) is None  # an earlier round's: this one's setup would have stopped on it
    store.set(FATAL_KEY, json.dumps({"restart": 0, "round": "round-2", "rank": 0, "exit_code": 2, "kind": "UsageError"}))
    assert recorded_fatal_error(ctx)["kind"] == "UsageError"

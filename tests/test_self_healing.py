"""Self-healing under real torchrun (anomalies.py): a poisoned sample, a transient fault, a persistent one.

The traced test job (tests/helpers/jobs.py) for two epochs (96 steps), durable snapshots every 10
steps. Equal references, precisely:

- a transient fault (one gradient element set to inf on rank 1 after the all-reduce, once) heals
  into the unbroken run's very bits;
- a poisoned sample (NaN inputs) is found to be the data by its replay; its rank's share of that
  step (16 samples) is skipped from then on, and the run ends with the bits of an unbroken run given
  that same skip list up front (``anomaly.skip_samples``) — the list the test works out from the
  sampler's order, not the one the run reports;
- both with the custom-loop API (its own backward and ``session.gradients_ok()``), and with
  ``train.virtual_shards``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from elastictrain.data.sampling import epoch_order
from tests.conftest import REPO_ROOT, job_env, parse_job, torchrun_launcher
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps

pytestmark = pytest.mark.torchrun

HEAL = ["train.max_epochs=2", "snapshot.durable.every_steps=10", "log.plots=false"]
SAMPLES, PER_RANK, WORLD = 1536, 16, 2  # the traced job: 32 samples a step
POISON_STEP = 21
ORDER = epoch_order(SAMPLES, 0, 0, True)  # epoch 0's global order (run.seed 0)
# The poisoned sample: rank 0's 6th of step 21. Its rank's share of that step is what the replay skips.
POISON = ORDER[(POISON_STEP - 1) * PER_RANK * WORLD + 5]
POISON_SKIPPED = sorted(ORDER[(POISON_STEP - 1) * PER_RANK * WORLD:(POISON_STEP - 1) * PER_RANK * WORLD + PER_RANK])
FAULT_STEP = 33


def run(workdir, name, extra=(), env=None, max_restarts=0):
    workdir.mkdir(parents=True, exist_ok=True)
    job = launch_job(workdir, name, [*HEAL, *extra], env=env, max_restarts=max_restarts)
    return job


def finished(job):
    assert job.wait(TIMEOUT_S) == 0, job.output()[-5000:]
    return parse_job(job.output())


def warnings(output: str) -> list[str]:
    return [line.split(" WARNING ", 1)[1] for line in output.splitlines() if " WARNING " in line and "straggler" not in line]


def every_rank(output: str) -> dict[int, tuple[list[int], str]]:
    """The custom loop's last line on each rank: the steps its ``gradients_ok`` held, and its parameters' hash."""
    found = re.findall(r"^rank (\d+) held steps \[([\d, ]*)\] params_sha256=(\w+)$", output, re.MULTILINE)
    return {int(rank): ([int(s) for s in held.split(",") if s.strip()], digest) for rank, held, digest in found}


def summary_hashes(output: str) -> dict[int, str]:
    """Each rank's run summary ``params_sha256`` (log.all_ranks=true: every rank logs its summary line)."""
    return {int(rank): digest for rank, digest in re.findall(
        r"\[elastictrain r(\d+) a\d+\] INFO run summary: .* params_sha256=(\w+)", output)}


def shown(run_dir) -> dict:
    """``elastictrain snapshots show --json`` of the newest snapshot: what an operator reads."""
    out = subprocess.run([sys.executable, "-m", "elastictrain", "snapshots", "show", str(run_dir / "snapshots"), "--json"],
                         capture_output=True, text=True, env={**os.environ, **job_env()}, timeout=120, check=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """One unbroken run per gradient sync (DDP, virtual shards): what a healed transient fault must equal."""
    results = {}

    def get(sync: str):
        if sync not in results:
            extra = ["train.virtual_shards=2"] if sync == "virtual_shards" else []
            results[sync] = finished(run(tmp_path_factory.mktemp(f"unbroken-{sync}"), "job", extra))
        return results[sync]

    return get


@pytest.fixture(scope="module")
def skip_reference(tmp_path_factory):
    """The unbroken run given the poisoned sample's share of its step as a skip list from the start."""
    listed = f"anomaly.skip_samples=[{','.join(map(str, POISON_SKIPPED))}]"
    return finished(run(tmp_path_factory.mktemp("skip-reference"), "job", [listed]))


def test_a_poisoned_sample_is_rolled_back_replayed_found_to_be_data_and_skipped(tmp_path, skip_reference):
    result = finished(run(tmp_path, "job", [f"task.args.poison={POISON}"]))
    said = warnings(result.output)
    assert said[0].startswith(f"anomaly at step {POISON_STEP}: loss nan on rank(s) 0 (host "), said
    assert said[0].endswith(f"; rolled back to step {POISON_STEP - 1} to replay it (rollback 1 of 4)"), said
    assert said[1].startswith(f"anomaly at step {POISON_STEP} recurred on replay (loss nan): it is the data; "
                              f"its {PER_RANK} samples (global indices "), said
    assert said[1].endswith(f"rolled back to step {POISON_STEP - 1} (rollback 2 of 4)"), said
    assert len(said) == 2, said
    assert result.summary["params_sha256"] == skip_reference.summary["params_sha256"]
    assert result.summary["attempts"] == "1", "healed in the running processes, no restart"
    document = shown(tmp_path / "run")
    assert document["anomalies"]["skipped_samples"] == POISON_SKIPPED and POISON in POISON_SKIPPED
    assert [(e["step"], e["decision"], e["origin"]) for e in document["anomalies"]["entries"]] == [
        (POISON_STEP, "rollback", [0]), (POISON_STEP, "data", [0])]
    assert document["goodput"]["seconds_by_cause"]["rollback"] > 0


def test_a_sigkill_in_the_middle_of_a_rollback_restarts_and_heals_the_same_way(tmp_path, skip_reference):
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir(parents=True)
    job = run(tmp_path, "job", [f"task.args.poison={POISON}"], max_restarts=1,
              env={"ELASTICTRAIN_FAILPOINT": f"rollback:{failpoints}", "ELASTICTRAIN_FAILPOINT_RANK": "1"})
    os.kill(int(procs.wait_for_file(failpoints / "failpoint-rollback.pid", TIMEOUT_S, job)), signal.SIGKILL)
    result = finished(job)
    assert start_steps(result.output) == [0, POISON_STEP - 1], "torchrun's restart resumes from the newest snapshot"
    assert result.summary["params_sha256"] == skip_reference.summary["params_sha256"]
    assert shown(tmp_path / "run")["anomalies"]["skipped_samples"] == POISON_SKIPPED


@pytest.mark.parametrize("sync", ["ddp", "virtual_shards"])
def test_a_transient_fault_on_one_rank_is_replayed_clean_and_the_run_ends_bitwise(tmp_path, unbroken, sync):
    # DDP with the default checks: rank 1 applies the inf, its loss of the next step is the first non-finite
    # number. Virtual shards with the gradient norm read at every step (anomaly.check_gradients=true): the step itself.
    extra, seen = ([], f"{FAULT_STEP + 1}: loss nan on rank(s) 1 (host ") if sync == "ddp" else (
        ["train.virtual_shards=2", "anomaly.check_gradients=true"], f"{FAULT_STEP}: gradient norm inf on rank(s) 1 (host ")
    job = run(tmp_path, "job", extra, env={"ELASTICTRAIN_FAULT": f"grad-inf@{FAULT_STEP}:{tmp_path}",
                                           "ELASTICTRAIN_FAULT_RANK": "1"})
    result = finished(job)
    said = warnings(result.output)
    assert said[0].startswith(f"anomaly at step {seen}"), said
    assert "; rolled back to step 30 to replay it (rollback 1 of 4)" in said[0], said
    assert said[1].startswith(f"step {seen.split(':')[0]} replayed clean: the anomaly ("), said
    assert "was a transient fault on rank(s) 1 (host " in said[1], said
    assert len(said) == 2, said
    assert result.summary["params_sha256"] == unbroken(sync).summary["params_sha256"]


def test_a_preemption_right_after_a_rollback_resumes_the_replay_and_concludes_it_bitwise(tmp_path, unbroken):
    # SIGTERM to the agent while rank 0 is inside the rollback: every rank stops at the step rolled back to, which
    # the durable store already holds, but without the replay. The next launch must still conclude it.
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir(parents=True)
    job = run(tmp_path, "job", [], env={"ELASTICTRAIN_FAULT": f"grad-inf@{FAULT_STEP}:{tmp_path}",
                                        "ELASTICTRAIN_FAULT_RANK": "1", "ELASTICTRAIN_FAILPOINT": f"rollback:{failpoints}",
                                        "ELASTICTRAIN_FAILPOINT_RANK": "0"})
    procs.wait_for_file(failpoints / "failpoint-rollback.pid", TIMEOUT_S, job)
    os.kill(job.proc.pid, signal.SIGTERM)
    (failpoints / "failpoint-rollback.resume").touch()
    job.wait(TIMEOUT_S)
    first = job.output()
    assert "preempted at step 30: snapshot committed" in first, first[-5000:]
    result = finished(run(tmp_path, "job2", []))
    assert start_steps(result.output) == [30]
    said = warnings(result.output)
    assert [line for line in said if line.startswith(f"step {FAULT_STEP + 1} replayed clean: the anomaly (")], said
    assert result.summary["params_sha256"] == unbroken("ddp").summary["params_sha256"]
    entries = shown(tmp_path / "run")["anomalies"]["entries"]
    assert [(e["step"], e["decision"]) for e in entries] == [(FAULT_STEP + 1, "rollback"), (FAULT_STEP + 1, "transient")]


def test_a_persistent_anomaly_stops_the_run_past_its_budget_with_one_line_and_the_snapshots_intact(tmp_path):
    # Every rank's gradients at every step from FAULT_STEP on: it recurs on every replay, like data, until the budget.
    job = run(tmp_path, "job", [], max_restarts=2,
              env={"ELASTICTRAIN_FAULT": f"grad-inf@{FAULT_STEP}+:{tmp_path}", "ELASTICTRAIN_FAULT_RANK": "all"})
    assert job.wait(TIMEOUT_S) != 0
    output = job.output()
    # torchrun's agent prints its own ChildFailedError traceback; no worker prints one (no elastictrain frame).
    assert not [line for line in output.splitlines() if 'File "' in line and "/elastictrain/" in line], output[-5000:]
    stops = [line for line in output.splitlines() if "anomaly.max_rollbacks=4: training stopped" in line]
    assert stops and all(f"anomaly at step {FAULT_STEP}" in line for line in stops), output[-5000:]
    assert "after 4 rollback(s)" in stops[0]
    assert start_steps(output) == [0], "the error is recorded for the restarts, which stop before restoring"
    verified = subprocess.run([sys.executable, "-m", "elastictrain", "snapshots", "verify", str(tmp_path / "run" / "snapshots")],
                              capture_output=True, text=True, env={**os.environ, **job_env()}, timeout=120)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert shown(tmp_path / "run")["step"] < FAULT_STEP


# -- the custom-loop API -------------------------------------------------------------------------

LOOP_ORDER = epoch_order(512, 0, 0, True)
LOOP_POISON = LOOP_ORDER[7 * 32 + 16 + 3]  # rank 1's 4th sample of step 8
LOOP_SKIPPED = sorted(LOOP_ORDER[7 * 32 + 16:8 * 32])


def loop_job(workdir, extra=(), env=None):
    workdir.mkdir(parents=True, exist_ok=True)
    command = [*torchrun_launcher(max_restarts=0), str(REPO_ROOT / "tests" / "helpers" / "healing_loop.py"),
               f"run.dir={workdir / 'run'}", *extra]
    return procs.launch(command, log_path=workdir / "job.log", env={**job_env(), **(env or {})}, cwd=workdir)


def test_a_custom_loop_heals_a_poisoned_sample_and_a_transient_fault(tmp_path):
    listed = f"anomaly.skip_samples=[{','.join(map(str, LOOP_SKIPPED))}]"
    jobs = {
        "reference": loop_job(tmp_path / "reference"),
        "skip-reference": loop_job(tmp_path / "skip-reference", [listed]),
    }
    results = {name: finished(job) for name, job in jobs.items()}
    poisoned = finished(loop_job(tmp_path / "poisoned", env={"HEAL_POISON": str(LOOP_POISON)}))
    said = warnings(poisoned.output)
    assert said[0].startswith("anomaly at step 8: loss nan on rank(s) 1 (host ") and "recurred on replay" in said[1], said
    # gradients_ok(loss=) saw rank 1's NaN loss before the update: rank 1 held step 8, then again in its replay. Under
    # rollback each rank answers alone (no collective): rank 0's loss was finite, so it took the NaN update and held
    # only later steps, whose losses were then non-finite; the vote rolled both back before anything was kept.
    held = {rank: held for rank, (held, _) in every_rank(poisoned.output).items()}
    assert held[1][0] == 8 and held[1].count(8) == 2 and 8 not in held[0], held
    assert poisoned.summary["params_sha256"] == results["skip-reference"].summary["params_sha256"]
    assert shown(tmp_path / "poisoned" / "run")["anomalies"]["skipped_samples"] == LOOP_SKIPPED

    # The transient fault with fast copies every 2 steps: the rollback reads node memory, not the durable store.
    # The gradient norm read at every step (anomaly.check_gradients=true): the fault is seen in its own step.
    fast = [f"snapshot.local.url={tmp_path / 'shm'}", "snapshot.local.every_steps=2", "anomaly.check_gradients=true"]
    faulted = finished(loop_job(tmp_path / "faulted", fast, env={"HEAL_FAULT": f"7:1:{tmp_path}"}))
    said = warnings(faulted.output)
    assert said[0].startswith("anomaly at step 7: gradient norm inf on rank(s) 1 (host ") and "replayed clean" in said[1], said
    assert "rolled back to step 6 from the node-local tier of node 0" in faulted.output, faulted.output[-4000:]
    assert faulted.summary["params_sha256"] == results["reference"].summary["params_sha256"]
    # Rank 1 alone saw its faulted gradients and held step 7; rank 0 took it; the rollback put both back.
    reference = results["reference"].summary["params_sha256"]
    assert every_rank(faulted.output) == {0: ([], reference), 1: ([7], reference)}
    assert results["reference"].summary["params_sha256"] != results["skip-reference"].summary["params_sha256"]


def test_skip_on_a_fault_in_one_ranks_gradients_is_taken_by_every_rank_in_a_custom_loop_and_a_trainer(tmp_path):
    # One gradient element set to inf after the all-reduce on one rank only: every rank must skip that step, or
    # the replicas part for good (skip has no rollback to mend them) and the run exits 0 with a wrong model.
    skip = ["anomaly.policy=skip"]
    loop = loop_job(tmp_path / "loop", skip, env={"HEAL_FAULT": f"7:1:{tmp_path},12:0:{tmp_path}"})
    trainer = run(tmp_path / "trainer", "job", [*skip, "train.max_epochs=1", "log.all_ranks=true"],
                  env={"ELASTICTRAIN_FAULT": f"grad-inf@{FAULT_STEP}:{tmp_path}", "ELASTICTRAIN_FAULT_RANK": "1"})
    looped = finished(loop)
    ranks = every_rank(looped.output)
    assert ranks.keys() == {0, 1} and ranks[0] == ranks[1] and ranks[0][0] == [7, 12], ranks
    said = [line for line in warnings(looped.output) if line.startswith("anomaly at step")]
    assert said[0].startswith("anomaly at step 7: gradient norm inf on rank(s) 1 (host "), said
    assert said[1].startswith("anomaly at step 12: gradient norm inf on rank(s) 0 (host "), said
    assert all(" only; the optimizer step was skipped on every rank (anomaly.policy=skip)" in line for line in said)
    assert len(said) == 2, said
    entries = shown(tmp_path / "loop" / "run")["anomalies"]["entries"]
    assert [(e["step"], e["decision"], e["ranks"]) for e in entries] == [(7, "skip", [1]), (12, "skip", [0])]

    trained = finished(trainer)
    hashes = summary_hashes(trained.output)
    assert hashes.keys() == {0, 1} and hashes[0] == hashes[1], hashes
    said = [line for line in warnings(trained.output) if line.startswith("anomaly at step")]
    assert len(said) == 1 and said[0].startswith(f"anomaly at step {FAULT_STEP}: gradient norm inf on rank(s) 1 ("), said


# -- the replica check -----------------------------------------------------------------------------

def committed_steps(root) -> list[int]:
    return sorted(int(manifest.parent.name.removeprefix("step-")) for manifest in root.rglob("manifest.json"))


FAST_EVERY = "snapshot.local.every_steps="


@pytest.mark.parametrize("raw_from, overrides, step, stops_before, durable, fast", [
    # The fast copy of step 3 agreed; the durable snapshot of step 5 does not.
    (4, [f"{FAST_EVERY}3"], 5, "the durable snapshot", [], [3]),
    # Steps 2, 4 and 5 agreed; the fast copy of step 6 does not.
    (6, [f"{FAST_EVERY}2"], 6, "the fast copy", [5], [4, 5]),
    # No snapshot at all: the run's end (all 32 steps) is checked, and its summary line is never printed.
    (1, ["snapshot.local.url=null", "snapshot.durable.every_steps=0", "snapshot.durable.on_done=false"], 32,
     "the run's end", [], []),
], ids=["durable", "fast-copy", "end"])
def test_a_loop_calling_the_module_instead_of_its_wrapper_stops_before_committing_and_is_not_restarted(
        tmp_path, raw_from, overrides, step, stops_before, durable, fast):
    """Each rank trains its own copy from step ``raw_from``: the next snapshot's check (or the run's end) stops the run
    in one line naming the ranks; nothing of that step is committed in either tier, and the restarts stop before
    training."""
    workdir = tmp_path / "job"
    workdir.mkdir()
    command = [*torchrun_launcher(max_restarts=1), str(REPO_ROOT / "tests" / "helpers" / "healing_loop.py"),
               f"run.dir={workdir / 'run'}", f"snapshot.local.url={tmp_path / 'shm'}", *overrides]
    job = procs.launch(command, log_path=workdir / "job.log", env={**job_env(), "HEAL_RAW_FROM": str(raw_from)},
                       cwd=workdir)
    assert job.wait(TIMEOUT_S) != 0
    output = job.output()
    said = [line for line in output.splitlines() if "the ranks' replicas differ" in line]
    expected = (f"the ranks' replicas differ at step {step}, before {stops_before}: ranks 0 | 1 hold different 'model' "
                "(parameters), 'optimizer' (optimizer state); nothing of this step was committed.")
    assert said and all(expected in line for line in said), output[-5000:]
    logged = [line for line in said if " ERROR rank " in line]  # one rank of the node says it (its script may repeat it)
    assert len(logged) == 1 and re.search(r"\[elastictrain r(\d) a0\] ERROR rank \1 stopped in state ", logged[0]), said
    assert not [line for line in output.splitlines() if 'File "' in line and "/elastictrain/" in line], output[-5000:]
    assert start_steps(output) == [0], "the error is recorded for the restarts, which stop before restoring"
    assert "run summary" not in output  # no rank reports its own params_sha256 as the run's
    assert committed_steps(workdir / "run" / "snapshots") == durable
    assert committed_steps(tmp_path / "shm") == fast

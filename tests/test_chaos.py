"""The chaos soak, two minutes of it: every kind of fault on one two-node job, and nothing lost.

``tests/helpers/chaos.py`` runs the job (two agents, warm restarts, S3 durable tier, tmpfs fast tier, virtual
shards) and throws a seeded schedule of every fault kind at it, one after another; an unbroken torchrun of the
same training runs beside it. The job must end with the unbroken run's very parameters, leave no process,
listening socket or /dev/shm file behind, and show each fault in its log and in goodput by cause.
``benchmarks/chaos.py`` is the same for N minutes, with the table of what each kind cost.
"""

from __future__ import annotations

import pytest

from tests.conftest import job_env, parse_job
from tests.helpers import chaos, procs

pytestmark = pytest.mark.torchrun

SEED = 34
STEPS = 1200
TIMEOUT_S = 420


def test_every_fault_kind_in_one_job_ends_bitwise_equal_to_an_unbroken_run_and_leaves_nothing(tmp_path, s3_server, s3_bucket):
    # Every kind once, one every ~6 s of training; the S3 server paused 12 s, agent 1 away 4-6 s, the tier full 4-6 s.
    faults = chaos.schedule(SEED, duration_s=60, every_s=6, first_s=3, pause_s=(12.0, 12.0), away_s=(4.0, 6.0),
                            full_s=(4.0, 6.0))
    assert sorted({fault.kind for fault in faults}) == sorted(chaos.KINDS)
    # Durable snapshots every 5 s: one starts within the 12 s pause and gives up (retry_for_s 5 s) before it ends, so
    # the pause shows in the log (every 8 s, one started 7.5 s in outlasted the pause and committed: no line).
    job = chaos.ChaosJob(tmp_path / "chaos", s3_server, s3_bucket, steps=STEPS, nan_step=STEPS // 2,
                         durable_every_s=5.0, timeout_s=TIMEOUT_S)
    (tmp_path / "unbroken").mkdir()
    unbroken = procs.launch(chaos.unbroken_command(tmp_path / "unbroken", STEPS), log_path=tmp_path / "unbroken.log",
                            env={**job_env(), **chaos.ENV}, cwd=tmp_path / "unbroken")
    try:
        job.start()
        job.run(faults)
        output = job.output()
        codes = {index: agent.proc.returncode for index, agent in job.nodes.agents.items()}
    finally:
        job.stop()
    assert codes == {0: 0, 1: 0}, output[-6000:]
    assert unbroken.wait(TIMEOUT_S) == 0, unbroken.output()[-4000:]

    summary = parse_job(job.nodes.agents[0].output()).summary
    assert summary["step"] == str(STEPS)
    assert summary["params_sha256"] == parse_job(unbroken.output()).summary["params_sha256"], "the bits differ"
    assert chaos.not_visible(output, faults) == []
    causes = chaos.goodput_by_cause(job.durable_url, s3_server.storage_options)["seconds_by_cause"]
    # Recompute is not asserted: survivor copies can leave every restart with no step to redo, and a rank 0 killed
    # itself leaves up to a second of its steps unrecorded (one run here redid 2 steps twice and counted none
    # before an ending rank 0 wrote its step). test_goodput.py counts it on a real store.
    for cause in ("restart", "restore", "rollback"):
        assert causes[cause] > 0, causes
    assert job.leftovers() == []


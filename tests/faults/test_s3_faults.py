"""A real S3 server (SeaweedFS on 127.0.0.1) that goes away during training, and kills with snapshots on S3.

The server is stopped with SIGSTOP: the kernel still accepts connections, nothing answers, the
way a hung endpoint behaves. Training must go on, say that snapshots are behind and since when,
catch up once the server answers, and end bitwise equal to the unbroken run.

The storage backend must not change the numbers: a run on S3 whose worker is SIGKILLed, and whose
rank 0 is SIGKILLed inside a snapshot write, ends with the params_sha256 of the unbroken reference
run on local disk, with exactly one restart per kill. The secret given in snapshot.durable.storage_options
appears neither in the job's output nor in the bytes of the snapshot it saved.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastictrain.storage.snapshot_store import SnapshotStore
from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import TIMEOUT_S, launch_job, start_steps
from tests.helpers.s3 import SECRET_KEY
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun


def s3_overrides(server, bucket: str, **timeouts) -> list[str]:
    options = server.storage_options
    overrides = [
        f"snapshot.durable.url=s3://{bucket}/run",
        f"snapshot.durable.storage_options.key={options['key']}",
        f"snapshot.durable.storage_options.secret={options['secret']}",
        f"snapshot.durable.storage_options.client_kwargs.endpoint_url={server.endpoint}",
    ]
    overrides += [f"snapshot.durable.storage_options.config_kwargs.{k}={v}" for k, v in timeouts.items()]
    return overrides


def assert_bitwise(workdir, reference, output: str) -> None:
    assert parse_job(output).summary["params_sha256"] == reference.result.summary["params_sha256"]
    for rank in (0, 1):
        assert stitch(read_traces(workdir / "trace", rank), start_steps(output)) == reference.traces[rank]


def test_an_s3_outage_longer_than_a_snapshot_interval_does_not_stop_training(tmp_path, reference_run, s3_server, s3_bucket):
    overrides = s3_overrides(s3_server, s3_bucket, connect_timeout=1, read_timeout=1) + [
        "snapshot.durable.retry_for_s=2", "task.args.pause_rank=0", "task.args.pause_at_step=40",
    ]
    job = launch_job(tmp_path, "job", overrides)
    marker = tmp_path / "trace" / "paused-rank0.pid"
    procs.wait_for_file(marker, TIMEOUT_S, job)
    with s3_server.paused():
        paused_at = time.monotonic()
        marker.with_suffix(".resume").touch()
        # Two snapshot intervals (steps 50 and 75) pass while the server does not answer.
        job.wait_for(lambda out: "snapshot at step 75 not committed" in out, TIMEOUT_S, "the second failed snapshot")
        outage_s = time.monotonic() - paused_at
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]
    output = job.output()
    print(f"S3 paused for {outage_s:.1f} s")
    assert "snapshot at step 50 not committed" in output
    assert "snapshots are behind since step 50: the newest committed one is step 25" in output
    assert "snapshots caught up at step 100" in output
    assert start_steps(output) == [0], "no restart: the outage cost no attempt"
    assert_bitwise(tmp_path, reference_run, output)
    store = SnapshotStore(f"s3://{s3_bucket}/run", s3_server.storage_options)
    assert [listing.step for listing in store.list_snapshots()] == [200, 225, 240]
    assert s3_server.storage_options["secret"] not in output


def test_sigkill_of_a_worker_then_of_rank0_inside_an_s3_snapshot_write_resumes_bitwise_and_keeps_the_secret(
        tmp_path, reference_run, s3_server, s3_bucket):
    """One job on S3, two kills: rank 1 in step 37 (the restart restores step 25), then, in the restarted
    attempt, rank 0 inside the write of step 75's snapshot, after model.pt and before the manifest (the
    restart skips the torn step 75 and restores step 50)."""
    url = f"s3://{s3_bucket}/run"
    options = s3_server.storage_options
    failpoints = tmp_path / "failpoints"
    failpoints.mkdir()
    # endpoint_url at the top of storage_options (the other tests pass it in client_kwargs): both reach s3fs.
    overrides = [f"snapshot.durable.url={url}", f"snapshot.durable.storage_options.endpoint_url={s3_server.endpoint}",
                 f"snapshot.durable.storage_options.key={options['key']}", f"snapshot.durable.storage_options.secret={options['secret']}",
                 "task.args.pause_rank=1", "task.args.pause_at_step=37"]
    job = launch_job(tmp_path, "job", overrides, env={"ELASTICTRAIN_FAILPOINT": f"snapshot-write@75:{failpoints}"})
    os.kill(int(procs.wait_for_file(tmp_path / "trace" / "paused-rank1.pid", TIMEOUT_S, job)), signal.SIGKILL)
    writer_pid = int(procs.wait_for_file(failpoints / "failpoint-snapshot-write.pid", TIMEOUT_S, job))
    store = SnapshotStore(url, options)
    torn = {listing.step: listing for listing in store.list_snapshots()}[75]
    assert torn.manifest is None, "the kill must land after model.pt and before the manifest"
    os.kill(writer_pid, signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]

    output = job.output()
    result = parse_job(output)
    assert f"skipping snapshot {url}/step-000000000075: no manifest" in output
    assert start_steps(output) == [0, 25, 50], "expected one restart per kill, from the newest committed S3 snapshot"
    assert result.summary["restart"] == "2"
    assert_bitwise(tmp_path, reference_run, output)
    assert all(listing.manifest is not None for listing in store.list_snapshots())

    assert SECRET_KEY not in output, "the secret leaked into the job's log"
    newest = store.list_snapshots()[-1]
    assert newest.manifest is not None and newest.step == int(result.summary["step"])
    client = s3_server.client()
    for name in newest.manifest.objects:
        raw = client.cat_file(f"{s3_bucket}/run/{newest.snapshot_id}/{name}")
        # The saved config must carry the secret redacted (done by the loop: config.to_dict(redact=True)).
        assert SECRET_KEY.encode() not in raw, f"the secret is in the saved {name}"

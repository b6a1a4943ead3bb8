"""The real job under real torchrun with its snapshots on a real S3 server: a SIGKILLed worker resumes bitwise.

The storage backend must not change the numbers: the faulted S3 run ends with the
params_sha256 of the unbroken reference run on local disk, with exactly one restart. The
secret given in snapshot.durable.storage_options appears neither in the job's output nor in the bytes
of the snapshot it saved.
"""

from __future__ import annotations

import os
import signal

import pytest

from elastictrain.storage import SnapshotStore
from tests.conftest import parse_job
from tests.helpers import procs
from tests.helpers.jobs import SNAPSHOT_EVERY, TIMEOUT_S, launch_job, start_steps
from tests.helpers.s3 import SECRET_KEY
from tests.helpers.tasks import read_traces, stitch

pytestmark = pytest.mark.torchrun

KILL_RANK, KILL_STEP = 1, 37


def test_sigkill_worker_with_snapshots_on_s3_resumes_bitwise(tmp_path, reference_run, s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    options = s3_server.storage_options
    overrides = [
        f"snapshot.durable.url={url}",
        f"snapshot.durable.storage_options.endpoint_url={s3_server.endpoint}",
        f"snapshot.durable.storage_options.key={options['key']}",
        f"snapshot.durable.storage_options.secret={options['secret']}",
        f"task.args.pause_rank={KILL_RANK}",
        f"task.args.pause_at_step={KILL_STEP}",
    ]
    job = launch_job(tmp_path, "job", overrides)
    pid = int(procs.wait_for_file(tmp_path / "trace" / f"paused-rank{KILL_RANK}.pid", TIMEOUT_S, job))
    os.kill(pid, signal.SIGKILL)
    assert job.wait(TIMEOUT_S) == 0, job.output()[-4000:]

    output = job.output()
    result = parse_job(output)
    last_snapshot = (KILL_STEP - 1) // SNAPSHOT_EVERY * SNAPSHOT_EVERY
    assert start_steps(output) == [0, last_snapshot], "expected exactly one restart, from the last S3 snapshot"
    assert result.summary["restart"] == "1"
    assert result.summary["params_sha256"] == reference_run.result.summary["params_sha256"]
    for rank in (0, 1):
        assert stitch(read_traces(tmp_path / "trace", rank), start_steps(output)) == reference_run.traces[rank]

    assert SECRET_KEY not in output, "the secret leaked into the job's log"
    store = SnapshotStore(url, options)
    newest = store.list_snapshots()[-1]
    assert newest.manifest is not None and newest.step == int(result.summary["step"])
    client = s3_server.client()
    for name in newest.manifest.objects:
        raw = client.cat_file(f"{s3_bucket}/run/{newest.snapshot_id}/{name}")
        # The saved config must carry the secret redacted (done by the loop: config.to_dict(redact=True)).
        assert SECRET_KEY.encode() not in raw, f"the secret is in the saved {name}"

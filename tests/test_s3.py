"""SnapshotStore against a real S3 server (SeaweedFS on 127.0.0.1): commits, corruption, outages, mistakes, the lease.

Every failure must be one line, surface within a bounded time (the upper bounds here only guard
against hanging) and never carry the secret.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import traceback

import pytest

from elastictrain.core.errors import StorageError, StorageUnavailable, StoreLeaseError
from elastictrain.storage.lease import LEASE_NAME
from elastictrain.storage.manifest import MANIFEST_NAME, snapshot_id_for_step
from elastictrain.storage.snapshot_store import SnapshotStore
from tests.helpers.s3 import ACCESS_KEY, SECRET_KEY

HANG_GUARD_S = 60  # generous: only catches a hang, not a slow machine


def write_bytes(data):
    return lambda handle: handle.write(data)


def commit_small(store, step):
    return store.commit(step, {"model.pt": write_bytes(f"model at step {step}".encode()), "state.pt": write_bytes(b"s" * 1000)},
                        meta={"epoch": step // 10})


@pytest.fixture
def url(s3_bucket):
    return f"s3://{s3_bucket}/run"


@pytest.fixture
def store(url, s3_server):
    return SnapshotStore(url, s3_server.storage_options, retry_for_s=5)


def prefixes(s3_server, bucket):
    """What a delimiter listing of the run shows, empty "directory" markers included."""
    response = s3_server.client().call_s3("list_objects_v2", Bucket=bucket, Prefix="run/", Delimiter="/")
    return sorted(p["Prefix"].rstrip("/").rsplit("/", 1)[-1] for p in response.get("CommonPrefixes", []))


def object_key(step, name):
    return f"run/{snapshot_id_for_step(step)}/{name}"


def assert_one_line_without_secret(exc: BaseException):
    message = str(exc)
    assert "\n" not in message, message
    text = "".join(traceback.format_exception(exc))
    assert SECRET_KEY not in text, text
    assert "botocore" not in text and "ClientError" not in text, text


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_round_trip_commit_list_verify_prune_leaves_no_markers(store, s3_server, s3_bucket):
    store.check_writable()
    manifests = {step: commit_small(store, step) for step in (10, 20, 30)}

    listings = store.list_snapshots()
    assert [(item.step, item.problem) for item in listings] == [(10, None), (20, None), (30, None)]
    manifest, payload = store.read_verified(snapshot_id_for_step(20))
    assert manifest == manifests[20]
    assert payload == {"model.pt": b"model at step 20", "state.pt": b"s" * 1000}
    assert store.latest_valid()[0] == manifests[30]

    assert store.prune(keep_last=2) == [snapshot_id_for_step(10)]
    assert prefixes(s3_server, s3_bucket) == [snapshot_id_for_step(20), snapshot_id_for_step(30)]
    commit_small(store, 40)
    # The emptied step-10 prefix must not come back as a "snapshot" to prune at every commit.
    assert store.prune(keep_last=2) == [snapshot_id_for_step(20)]
    assert prefixes(s3_server, s3_bucket) == [snapshot_id_for_step(30), snapshot_id_for_step(40)]


def flip_one_byte(client, bucket, step):
    path = f"{bucket}/{object_key(step, 'state.pt')}"
    data = bytearray(client.cat_file(path))
    data[len(data) // 2] ^= 0x01
    client.pipe_file(path, bytes(data))


def truncate(client, bucket, step):
    path = f"{bucket}/{object_key(step, 'state.pt')}"
    client.pipe_file(path, client.cat_file(path)[:-1])


def delete_manifest(client, bucket, step):
    client.rm(f"{bucket}/{object_key(step, MANIFEST_NAME)}")


@pytest.mark.parametrize("corrupt, fragment", [
    (flip_one_byte, "xxh3_128 mismatch"), (truncate, "size mismatch"), (delete_manifest, "no manifest"),
])
def test_corrupt_newest_falls_back_to_previous_with_one_warning(store, s3_server, s3_bucket, caplog, corrupt, fragment):
    commit_small(store, 10)
    commit_small(store, 20)
    corrupt(s3_server.client(), s3_bucket, 20)

    with caplog.at_level(logging.WARNING, logger="elastictrain.storage.snapshot_store"):
        manifest, _ = store.latest_valid()
    assert manifest.step == 10
    [warning] = warnings_of(caplog)
    assert snapshot_id_for_step(20) in warning and fragment in warning


def test_torn_prefix_is_never_chosen_and_a_later_prune_deletes_it(store, s3_server, s3_bucket):
    commit_small(store, 10)
    s3_server.client().pipe_file(f"{s3_bucket}/{object_key(15, 'model.pt')}", b"half written")
    commit_small(store, 20)
    assert store.latest_valid()[0].step == 20
    assert [(item.step, item.manifest is None) for item in store.list_snapshots()] == [(10, False), (15, True), (20, False)]

    commit_small(store, 30)
    assert store.prune(keep_last=2) == [snapshot_id_for_step(10), snapshot_id_for_step(15)]
    assert prefixes(s3_server, s3_bucket) == [snapshot_id_for_step(20), snapshot_id_for_step(30)]


def test_missing_bucket_is_one_line_naming_it(s3_server):
    store = SnapshotStore("s3://no-such-bucket-here/run", s3_server.storage_options, retry_for_s=5)
    started = time.monotonic()
    with pytest.raises(StorageError) as raised:
        store.check_writable()
    assert time.monotonic() - started < HANG_GUARD_S
    assert not isinstance(raised.value, StorageUnavailable)
    assert str(raised.value) == (
        f"bucket 'no-such-bucket-here' does not exist at endpoint {s3_server.endpoint}; create it or fix snapshot.durable.url "
        "(now s3://no-such-bucket-here/run)"
    )
    assert_one_line_without_secret(raised.value)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
        store.list_snapshots()
    assert "no-such-bucket-here" not in s3_server.client().ls("", refresh=True)  # nothing created it


@pytest.mark.parametrize("wrong", ["secret", "key"])
def test_wrong_credentials_are_refused_not_retried(url, s3_server, wrong):
    options = s3_server.storage_options
    options[wrong] = "wrong-" + SECRET_KEY  # the wrong value must not leak either
    store = SnapshotStore(url, options, retry_for_s=30)
    for action in (store.check_writable, lambda: commit_small(store, 10), store.list_snapshots):
        started = time.monotonic()
        with pytest.raises(StorageError) as raised:
            action()
        assert time.monotonic() - started < 10, "a refused credential must not be retried for retry_for_s"
        assert type(raised.value) is StorageError and not raised.value.retryable
        assert f"the endpoint {s3_server.endpoint} refused the credentials" in str(raised.value)
        assert "check key/secret in snapshot.durable.storage_options or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY" in str(raised.value)
        assert_one_line_without_secret(raised.value)


def test_unreachable_endpoint_is_unavailable_within_bounded_time(s3_bucket):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    options = {"key": ACCESS_KEY, "secret": SECRET_KEY, "endpoint_url": f"http://127.0.0.1:{port}"}
    store = SnapshotStore(f"s3://{s3_bucket}/run", options, retry_for_s=2)
    started = time.monotonic()
    with pytest.raises(StorageUnavailable) as raised:
        store.check_writable()
    assert time.monotonic() - started < HANG_GUARD_S
    assert raised.value.retryable
    message = str(raised.value)
    assert message.startswith(f"snapshot store s3://{s3_bucket}/run is not writable: the store did not answer for ")
    assert f"check that the endpoint http://127.0.0.1:{port} is up and reachable" in message
    assert_one_line_without_secret(raised.value)


def test_credentials_from_aws_environment_variables(url, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    store = SnapshotStore(url, {"endpoint_url": s3_server.endpoint}, retry_for_s=5)
    store.check_writable()
    commit_small(store, 10)
    assert store.latest_valid()[0].step == 10

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + SECRET_KEY)
    with pytest.raises(StorageError, match="refused the credentials") as raised:
        SnapshotStore(url, {"endpoint_url": s3_server.endpoint}, retry_for_s=5).list_snapshots()
    assert_one_line_without_secret(raised.value)


def test_paused_server_gives_unavailable_then_next_commit_succeeds(url, s3_server, store):
    commit_small(store, 10)
    paused_store = SnapshotStore(url, s3_server.storage_options, retry_for_s=3)
    with s3_server.paused():
        started = time.monotonic()
        with pytest.raises(StorageUnavailable) as raised:
            commit_small(paused_store, 20)
        took = time.monotonic() - started
    # retry_for_s plus one attempt's limit (connect 3 s + read 3 s), plus slack for a loaded machine.
    assert took < 3 + 6 + 10, took
    assert f"snapshot {url}/step-000000000020 could not be written: the store did not answer for" in str(raised.value)
    assert_one_line_without_secret(raised.value)

    listings = {item.step: item for item in store.list_snapshots()}
    assert listings[10].manifest is not None
    assert 20 not in listings or listings[20].manifest is None, "a failed commit must leave no manifest"
    commit_small(paused_store, 30)
    manifest, payload = paused_store.latest_valid()
    assert manifest.step == 30 and payload["model.pt"] == b"model at step 30"


def test_server_stopping_between_listing_and_upload_is_unavailable_not_a_hang(url, s3_server):
    """The server stops while the first object is being staged, so the PUT meets a silent server.

    aiohttp waits for a PUT's "100 Continue" with no timeout at all; only the per-attempt limit ends it.
    """
    options = {**s3_server.storage_options, "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
    store = SnapshotStore(url, options, retry_for_s=2)

    def stop_server_then_write(handle):
        os.kill(s3_server.proc.pid, signal.SIGSTOP)
        handle.write(b"model bytes")

    started = time.monotonic()
    try:
        with pytest.raises(StorageUnavailable, match="could not be written: the store did not answer"):
            store.commit(20, {"model.pt": stop_server_then_write}, meta={})
    finally:
        os.kill(s3_server.proc.pid, signal.SIGCONT)
    assert time.monotonic() - started < HANG_GUARD_S


def test_server_back_within_retry_for_s_the_commit_is_retried_and_succeeds(url, s3_server):
    options = {**s3_server.storage_options, "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
    store = SnapshotStore(url, options, retry_for_s=20)
    commit_small(store, 10)
    with s3_server.paused():
        resume = threading.Timer(2.5, os.kill, (s3_server.proc.pid, signal.SIGCONT))
        resume.start()
        try:
            manifest = commit_small(store, 20)  # attempts time out, back off, and go on once it answers
        finally:
            resume.cancel()
    assert store.read_verified(manifest.snapshot_id)[1]["model.pt"] == b"model at step 20"


def test_server_killed_and_restarted_keeps_committed_snapshots(store, s3_server):
    for step in (10, 20):
        commit_small(store, step)
    s3_server.restart_after_kill()
    assert [item.step for item in store.list_snapshots()] == [10, 20]
    assert store.latest_valid()[1]["model.pt"] == b"model at step 20"
    commit_small(store, 30)
    assert store.latest_valid()[0].step == 30


def owner(run_id, token, pid=None, host=None):
    return {"run_id": run_id, "token": token, "host": host or socket.gethostname(), "pid": pid or os.getpid(),
            "started_unix": time.time()}


def test_lease_refuses_a_second_run_and_names_the_first(url, s3_server, store):
    store.acquire_lease(owner("run-a", "token-a"), stale_after_s=60)
    other = SnapshotStore(url, s3_server.storage_options, retry_for_s=5)
    with pytest.raises(StoreLeaseError) as raised:
        other.acquire_lease(owner("run-b", "token-b"), stale_after_s=60)
    message = str(raised.value)
    assert f"snapshot store {url} is in use: run run-a (host {socket.gethostname()}, pid {os.getpid()}, last renewed" in message
    assert "use another snapshot.durable.url, or set snapshot.durable.lease_stale_after_s=0" in message
    assert json.loads(s3_server.client().cat_file(f"{url[5:]}/{LEASE_NAME}"))["token"] == "token-a"  # untouched

    # The lease is not a snapshot: listing and pruning ignore it.
    commit_small(store, 10)
    commit_small(store, 20)
    assert [item.step for item in store.list_snapshots()] == [10, 20]
    store.prune(keep_last=1)
    store.renew_lease()

    # The same job restarted (same token) takes it over; release frees it for the other run.
    restarted = SnapshotStore(url, s3_server.storage_options, retry_for_s=5)
    restarted.acquire_lease(owner("run-a attempt 2", "token-a"), stale_after_s=60)
    restarted.release_lease()
    other.acquire_lease(owner("run-b", "token-b"), stale_after_s=60)
    assert json.loads(s3_server.client().cat_file(f"{url[5:]}/{LEASE_NAME}"))["run_id"] == "run-b"


def test_stale_lease_is_taken_over(url, s3_server, store, caplog):
    store.acquire_lease(owner("run-a", "token-a"), stale_after_s=0.5)
    time.sleep(1.0)
    other = SnapshotStore(url, s3_server.storage_options, retry_for_s=5)
    with caplog.at_level(logging.WARNING, logger="elastictrain.storage.snapshot_store"):
        other.acquire_lease(owner("run-b", "token-b"), stale_after_s=0.5)
    assert any("taking over the stale lease" in w and "run-a" in w for w in warnings_of(caplog))
    with pytest.raises(StoreLeaseError, match="taken over by run run-b"):
        store.renew_lease()


def test_lease_of_a_dead_process_on_this_host_is_stale(url, s3_server, store):
    with socket.socket() as _:
        dead_pid = os.fork()
        if dead_pid == 0:
            os._exit(0)
        os.waitpid(dead_pid, 0)
    store.acquire_lease(owner("run-a", "token-a", pid=dead_pid), stale_after_s=600)
    other = SnapshotStore(url, s3_server.storage_options, retry_for_s=5)
    other.acquire_lease(owner("run-b", "token-b"), stale_after_s=600)


def test_stale_after_zero_disables_the_lease(url, s3_server, store):
    store.acquire_lease(owner("run-a", "token-a"), stale_after_s=60)
    other = SnapshotStore(url, s3_server.storage_options, retry_for_s=5)
    other.acquire_lease(owner("run-b", "token-b"), stale_after_s=0)
    other.renew_lease()
    other.release_lease()
    assert json.loads(s3_server.client().cat_file(f"{url[5:]}/{LEASE_NAME}"))["token"] == "token-a"

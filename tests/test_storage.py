"""SnapshotStore: only committed, verified snapshots exist for readers.

Torn and corrupt snapshots are skipped with a warning and never deleted by readers; every test
runs against a local directory and a fresh memory:// root.
"""

import errno
import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid

import fsspec
import pytest
import xxhash

from elastictrain.core.errors import SnapshotError, StorageError
from elastictrain.storage.manifest import MANIFEST_NAME, MANIFEST_VERSION, Manifest, ObjectEntry, snapshot_id_for_step
from elastictrain.storage.snapshot_store import SnapshotStore

BIG_CHUNK = bytes(range(256)) * 4096  # 1 MiB
BIG_OBJECT = b"".join(BIG_CHUNK[i:] + BIG_CHUNK[:i] for i in range(5))  # 5 MiB, not periodic


FORMAT = "elastictrain-snapshot"


def write_bytes(data):
    return lambda handle: handle.write(data)


def write_in_chunks(data, chunk_size=64 * 1024):
    def writer(handle):
        for start in range(0, len(data), chunk_size):
            handle.write(data[start : start + chunk_size])

    return writer


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "snapshots")
        return
    root = f"memory://test-storage-{uuid.uuid4().hex}/run"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def store(url):
    return SnapshotStore(url)


def commit_small(store, step, text=None):
    payload = (text or f"model at step {step}").encode()
    return store.commit(step, {"model": write_bytes(payload)}, meta={"epoch": step // 10})


def object_path(store, step, name):
    return f"{store.root}/{snapshot_id_for_step(step)}/{name}"


def make_torn(store, step):
    """A prefix with payload but no manifest, as a kill between payload and manifest leaves it."""
    store.fs.makedirs(f"{store.root}/{snapshot_id_for_step(step)}", exist_ok=True)
    store.fs.pipe_file(object_path(store, step, "model"), b"half-written")


def warning_messages(caplog):
    return [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]


def test_snapshot_ids_sort_like_steps():
    steps = [0, 9, 10, 100, 99999, 123456789012]
    ids = [snapshot_id_for_step(step) for step in steps]
    assert ids[1] == "step-000000000009"
    assert sorted(ids) == ids


def test_manifest_round_trips_and_declares_format():
    manifest = Manifest(
        snapshot_id="step-000000000007",
        step=7,
        created_unix=1234.5,
        objects={"model": ObjectEntry(size=3, algorithm="xxh3_128", digest="ab" * 16)},
        meta={"epoch": 2, "world_size": 4},
    )
    document = json.loads(manifest.to_json())
    assert document["manifest_version"] == MANIFEST_VERSION
    assert document["format"] == "elastictrain-snapshot"
    assert Manifest.from_json(manifest.to_json(), "here") == manifest


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"format": "other"}', "not an elastictrain-snapshot manifest"),
        (b'{"format": "elastictrain-snapshot", "manifest_version": 1}', "lacks a field"),
        (
            json.dumps({"format": FORMAT, "manifest_version": MANIFEST_VERSION + 1}).encode(),
            f"has manifest_version {MANIFEST_VERSION + 1}, this elastictrain reads up to {MANIFEST_VERSION}; upgrade elastictrain",
        ),
    ],
)
def test_manifest_from_json_rejects_bad_input_naming_where(data, fragment):
    with pytest.raises(SnapshotError, match=fragment) as raised:
        Manifest.from_json(data, "s3://bkt/run/step-000000000001/manifest.json")
    assert "s3://bkt/run/step-000000000001/manifest.json" in str(raised.value)


def test_commit_then_read_returns_exact_bytes_and_hashes(store):
    small = b"optimizer state \x00\x01\x02"
    manifest = store.commit(
        40,
        {"model": write_in_chunks(BIG_OBJECT), "optim": write_bytes(small)},
        meta={"epoch": 3, "world_size": 2},
    )
    assert manifest.snapshot_id == "step-000000000040"
    assert manifest.objects == {
        "model": ObjectEntry(len(BIG_OBJECT), "xxh3_128", xxhash.xxh3_128(BIG_OBJECT).hexdigest()),
        "optim": ObjectEntry(len(small), "xxh3_128", xxhash.xxh3_128(small).hexdigest()),
    }

    [listing] = store.list_snapshots()
    assert (listing.snapshot_id, listing.step, listing.problem) == ("step-000000000040", 40, None)
    assert listing.manifest == manifest

    read_manifest, payload = store.read_verified("step-000000000040")
    assert read_manifest == manifest
    assert read_manifest.meta == {"epoch": 3, "world_size": 2}
    assert payload == {"model": BIG_OBJECT, "optim": small}


def test_new_snapshots_record_their_checksum_algorithm(store):
    commit_small(store, 10)
    document = json.loads(store.fs.cat_file(object_path(store, 10, MANIFEST_NAME)))
    data = b"model at step 10"
    assert document["manifest_version"] == 2
    assert document["objects"] == {"model": {"size": len(data), "algorithm": "xxh3_128",
                                             "digest": xxhash.xxh3_128(data).hexdigest()}}


def test_an_unknown_checksum_algorithm_is_one_line_and_the_snapshot_is_skipped(store, url, caplog):
    commit_small(store, 10)
    commit_small(store, 20)
    path = object_path(store, 20, MANIFEST_NAME)
    document = json.loads(store.fs.cat_file(path))
    document["objects"]["model"]["algorithm"] = "blake9"
    store.fs.pipe_file(path, json.dumps(document).encode())

    with pytest.raises(SnapshotError) as raised:
        store.read_verified("step-000000000020")
    assert str(raised.value) == (
        f"snapshot {url}/step-000000000020 is corrupt: manifest {url}/step-000000000020/{MANIFEST_NAME} checks object "
        "'model' with 'blake9', which this elastictrain does not know (it knows xxh3_128); upgrade elastictrain "
        "to resume from it"
    )
    with caplog.at_level(logging.WARNING, logger="elastictrain.storage.snapshot_store"):
        assert store.latest_valid()[0].step == 10
    assert "'blake9'" in warning_messages(caplog)[0]


def test_large_writes_are_checksummed_in_order_and_done_with_the_buffer_when_write_returns(store):
    # The digest is of the bytes in order, and of the bytes as they were during the call: a file's
    # caller may reuse its buffer as soon as write() returns (torch.save frees or reuses its own),
    # so a checksum computed later (on another thread, say) must not see the reuse.
    reused = bytearray(BIG_OBJECT[: 2 << 20])
    expected = b"head" + BIG_OBJECT + bytes(reused) + b"tail"

    def writer(handle):
        handle.write(b"head")
        handle.write(BIG_OBJECT)
        handle.write(reused)
        reused[:] = bytes(len(reused))  # the caller reuses its buffer at once
        handle.write(b"tail")

    manifest = store.commit(10, {"model": writer}, meta={})
    assert manifest.objects["model"] == ObjectEntry(len(expected), "xxh3_128", xxhash.xxh3_128(expected).hexdigest())
    assert store.read_verified("step-000000000010")[1] == {"model": expected}


def test_commit_timings_say_where_the_time_went(store):
    def slow_writer(handle):
        time.sleep(0.05)  # the writer's own work, e.g. torch.save pickling
        handle.write(BIG_OBJECT)

    manifest = store.commit(10, {"model": slow_writer, "optim": write_bytes(b"abc")}, meta={})
    timings = store.last_commit_timings
    assert timings.size_bytes == len(BIG_OBJECT) + 3 == sum(entry.size for entry in manifest.objects.values())
    assert timings.serialise_s >= 0.05  # the sleep, not the write: it is outside write()
    parts = timings.serialise_s + timings.hash_s + timings.write_s + timings.fsync_s + timings.upload_s + timings.manifest_s
    assert 0 < parts <= timings.total_s


def test_writer_sees_position_and_no_seeking(store):
    seen = {}

    def writer(handle):
        seen["writable"], seen["seekable"] = handle.writable(), handle.seekable()
        handle.write(b"abc")
        handle.write(bytearray(b"de"))
        handle.flush()
        seen["tell"] = handle.tell()

    manifest = store.commit(1, {"model": writer}, meta={})
    assert seen == {"writable": True, "seekable": False, "tell": 5}
    assert manifest.objects["model"] == ObjectEntry(5, "xxh3_128", xxhash.xxh3_128(b"abcde").hexdigest())


def test_torn_snapshot_is_listed_with_problem_and_skipped(store, caplog):
    commit_small(store, 10)
    make_torn(store, 20)

    listings = store.list_snapshots()
    assert [(item.snapshot_id, item.problem) for item in listings] == [
        ("step-000000000010", None),
        ("step-000000000020", "no manifest (torn or in-progress write)"),
    ]
    assert listings[1].manifest is None

    with caplog.at_level(logging.WARNING, logger="elastictrain.storage.snapshot_store"):
        manifest, payload = store.latest_valid()
    assert manifest.step == 10
    assert payload == {"model": b"model at step 10"}
    warnings = warning_messages(caplog)
    assert len(warnings) == 1
    assert "step-000000000020" in warnings[0] and "no manifest" in warnings[0]


def flip_one_byte(store, step):
    path = object_path(store, step, "model")
    data = bytearray(store.fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    store.fs.pipe_file(path, bytes(data))


def truncate(store, step):
    path = object_path(store, step, "model")
    store.fs.pipe_file(path, store.fs.cat_file(path)[:-1])


def delete_object(store, step):
    store.fs.rm(object_path(store, step, "model"))


def garble_manifest(store, step):
    store.fs.pipe_file(object_path(store, step, MANIFEST_NAME), b'{"format": "elastictrain-sn')


@pytest.mark.parametrize(
    "corrupt, fragment",
    [
        (flip_one_byte, "object 'model' xxh3_128 mismatch"),
        (truncate, "object 'model' size mismatch"),
        (delete_object, "object 'model' is missing"),
        (garble_manifest, "manifest.json is not valid JSON"),
    ],
)
def test_corrupt_snapshot_is_refused_and_previous_one_used(store, url, caplog, corrupt, fragment):
    commit_small(store, 10)
    commit_small(store, 20)
    corrupt(store, 20)

    with pytest.raises(SnapshotError) as raised:
        store.read_verified("step-000000000020")
    message = str(raised.value)
    assert message.startswith(f"snapshot {url}/step-000000000020 is corrupt: ")
    assert fragment in message

    with caplog.at_level(logging.WARNING, logger="elastictrain.storage.snapshot_store"):
        manifest, payload = store.latest_valid()
    assert manifest.snapshot_id == "step-000000000010"
    assert payload == {"model": b"model at step 10"}
    warnings = warning_messages(caplog)
    assert len(warnings) == 1 and "step-000000000020" in warnings[0]


def test_none_valid_raises_and_deletes_nothing(store, url):
    commit_small(store, 10)
    flip_one_byte(store, 10)
    make_torn(store, 20)
    before = {path: store.fs.cat_file(path) for path in store.fs.find(store.root)}

    with pytest.raises(SnapshotError) as raised:
        store.latest_valid()
    message = str(raised.value)
    assert f"found 2 snapshot prefix(es) under {url} but none verifies" in message
    assert "nothing was deleted" in message

    after = {path: store.fs.cat_file(path) for path in store.fs.find(store.root)}
    assert after == before
    assert [item.snapshot_id for item in store.list_snapshots()] == [
        "step-000000000010",
        "step-000000000020",
    ]


def test_missing_or_empty_root_has_no_snapshot(store):
    assert store.list_snapshots() == []
    assert store.latest_valid() is None
    store.fs.makedirs(store.root, exist_ok=True)
    store.fs.pipe_file(f"{store.root}/notes.txt", b"not a snapshot")
    assert store.latest_valid() is None


def test_prune_keeps_newest_committed_and_newer_torn(store):
    make_torn(store, 5)
    for step in (10, 20):
        commit_small(store, step)
    make_torn(store, 25)
    for step in (30, 40):
        commit_small(store, step)
    make_torn(store, 50)

    deleted = store.prune(keep_last=2)

    assert deleted == [snapshot_id_for_step(step) for step in (5, 10, 20, 25)]
    assert [item.snapshot_id for item in store.list_snapshots()] == [
        "step-000000000030",
        "step-000000000040",
        "step-000000000050",
    ]
    assert store.fs.cat_file(object_path(store, 50, "model")) == b"half-written"
    assert store.latest_valid()[1] == {"model": b"model at step 40"}


def test_prune_keeps_keep_last_intact_snapshots_when_the_newest_is_truncated(store):
    for step in (10, 20, 30):
        commit_small(store, step)
    truncate(store, 30)  # committed, then cut short: a resume skips it, so it must not count as kept
    commit_small(store, 25)  # the resumed run's next snapshot

    deleted = store.prune(keep_last=3)

    assert deleted == []  # 10, 20 and 25 are the 3 intact ones; the truncated 30 stays for a person to look at
    assert [item.step for item in store.list_snapshots()] == [10, 20, 25, 30]
    commit_small(store, 40)
    assert store.prune(keep_last=3) == [snapshot_id_for_step(10)]


def test_prune_without_committed_snapshot_deletes_nothing(store):
    make_torn(store, 5)
    assert store.prune(keep_last=1) == []
    assert [item.step for item in store.list_snapshots()] == [5]
    with pytest.raises(ValueError):
        store.prune(keep_last=0)


def test_commit_over_existing_prefix_replaces_stale_objects(store):
    store.commit(10, {"model": write_bytes(b"old"), "extra": write_bytes(b"stale")}, meta={})
    make_torn(store, 10)  # also leave a torn overwrite of the model behind

    manifest = store.commit(10, {"model": write_bytes(b"new")}, meta={"attempt": 2})

    prefix = f"{store.root}/step-000000000010"
    names = sorted(path.rsplit("/", 1)[-1] for path in store.fs.find(prefix))
    assert names == [MANIFEST_NAME, "model"]
    assert set(manifest.objects) == {"model"}
    assert store.read_verified("step-000000000010")[1] == {"model": b"new"}


def test_writer_error_propagates_and_removes_its_own_torn_prefix(store):
    commit_small(store, 10)
    make_torn(store, 5)  # another prefix: a failed commit touches only its own

    def broken_writer(handle):
        handle.write(b"partial")
        raise ValueError("bug in state_dict")

    with pytest.raises(ValueError, match="bug in state_dict"):
        store.commit(20, {"a": write_bytes(b"fine"), "b": broken_writer}, meta={})

    assert not store.fs.exists(f"{store.root}/step-000000000020")
    listings = store.list_snapshots()
    assert [(item.step, item.problem is None) for item in listings] == [(5, False), (10, True)]
    assert store.latest_valid()[0].step == 10


def test_check_writable_leaves_nothing_behind(store):
    store.check_writable()
    assert store.fs.ls(store.root) == []


def test_local_commit_leaves_no_temp_files(tmp_path):
    store = SnapshotStore(f"file://{tmp_path}/snapshots")
    store.commit(3, {"model": write_in_chunks(BIG_OBJECT), "optim": write_bytes(b"x")}, meta={})
    assert os.listdir(tmp_path / "snapshots") == ["step-000000000003"]
    assert sorted(os.listdir(tmp_path / "snapshots" / "step-000000000003")) == [
        MANIFEST_NAME,
        "model",
        "optim",
    ]


def test_local_writer_error_leaves_no_temp_file(tmp_path):
    store = SnapshotStore(str(tmp_path))

    def broken_writer(handle):
        handle.write(b"partial")
        raise ValueError("bug")

    with pytest.raises(ValueError):
        store.commit(1, {"model": broken_writer}, meta={})
    assert os.listdir(tmp_path) == []


KILLED_COMMIT = """
import os, sys
from elastictrain.storage import commit
from elastictrain.storage.snapshot_store import SnapshotStore

url, kill_at = sys.argv[1], sys.argv[2]
if kill_at == "before-manifest":  # every payload byte written and fsynced, the manifest not begun
    commit.write_local_atomically = lambda *args, **kwargs: os._exit(9)

def optim(handle):
    handle.write(b"optim ")
    if kill_at == "mid-payload":
        os._exit(9)
    handle.write(b"at step 20")

SnapshotStore(url).commit(20, {"model": lambda handle: handle.write(b"model at step 20"), "optim": optim}, meta={})
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["mid-payload", "before-manifest"])
def test_a_local_commit_killed_before_its_manifest_is_never_loaded_and_pruned_later(tmp_path, caplog, kill_at):
    """Payload objects go straight to their final names: a prefix without a manifest is torn, whatever it holds."""
    url = str(tmp_path / "snapshots")
    store = SnapshotStore(url)
    commit_small(store, 10)

    killed = subprocess.run([sys.executable, "-c", KILLED_COMMIT, url, kill_at], capture_output=True, text=True)
    assert killed.returncode == 9, killed.stderr

    torn = tmp_path / "snapshots" / "step-000000000020"
    assert sorted(os.listdir(torn)) == ["model", "optim"]  # no manifest, and no temporary names
    if kill_at == "before-manifest":  # complete, checksummable payload: still not a snapshot
        assert (torn / "optim").read_bytes() == b"optim at step 20"
    listings = store.list_snapshots()
    assert [(item.step, item.problem) for item in listings] == [(10, None), (20, "no manifest (torn or in-progress write)")]
    with caplog.at_level(logging.WARNING):
        manifest, payload = store.latest_valid()
    assert (manifest.step, payload) == (10, {"model": b"model at step 10"})
    assert any("step-000000000020" in message and "no manifest" in message for message in warning_messages(caplog))

    commit_small(store, 30)
    assert store.prune(keep_last=1) == ["step-000000000010", "step-000000000020"]
    assert sorted(os.listdir(url)) == ["step-000000000030"]


def test_a_failed_payload_fsync_fails_the_commit_and_removes_its_prefix(tmp_path, monkeypatch):
    """A payload file's fsync runs beside the next object's write; its failure is the commit's failure."""
    url = str(tmp_path / "snapshots")
    store = SnapshotStore(url)
    commit_small(store, 10)
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/step-000000000020/model"):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError, match=r"snapshot .*step-000000000020 could not be written \(.*Input/output error"):
        store.commit(20, {"model": write_bytes(b"model at step 20"), "optim": write_in_chunks(BIG_OBJECT)}, meta={})

    assert sorted(os.listdir(url)) == ["step-000000000010"]
    assert store.latest_valid()[1] == {"model": b"model at step 10"}


def test_check_writable_reports_url_when_path_is_unusable(tmp_path):
    blocker = tmp_path / "a-regular-file"
    blocker.write_bytes(b"")
    url = str(blocker / "snapshots")

    with pytest.raises(StorageError) as raised:
        SnapshotStore(url).check_writable()
    message = str(raised.value)
    assert url in message
    assert "check the path/credentials or set snapshot.durable.url" in message
    assert "\n" not in message


def test_commit_to_unusable_path_raises_storage_error(tmp_path):
    blocker = tmp_path / "a-regular-file"
    blocker.write_bytes(b"")
    url = str(blocker / "snapshots")

    with pytest.raises(StorageError, match="step-000000000001"):
        SnapshotStore(url).commit(1, {"model": write_bytes(b"x")}, meta={})


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 600 KiB tmpfs: a real device that fills up (needs root; skipped where mount is not permitted)."""
    mount_point = tmp_path / "small-device"
    mount_point.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount_point)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.strip() or result.returncode}); the disk-full test needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@pytest.mark.slow
def test_disk_full_is_one_clear_error_and_earlier_snapshots_stay_intact(small_tmpfs):
    url = str(small_tmpfs / "snapshots")
    store = SnapshotStore(url)
    for step in (10, 20):
        commit_small(store, step)
    free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
    too_big = bytes(free + 200_000)

    with pytest.raises(StorageError) as raised:
        store.commit(30, {"model": write_bytes(b"fits"), "state": write_in_chunks(too_big)}, meta={})
    message = str(raised.value)
    assert "\n" not in message
    needed = re.search(r"the device is full \(needed ~(\d+) bytes, (\d+) bytes free\)", message)
    assert message.startswith(f"snapshot {url}/step-000000000030 could not be written: the device is full"), message
    assert needed and int(needed.group(1)) == len(too_big) + len(b"fits")
    assert message.endswith("free space or point snapshot.durable.url elsewhere — earlier snapshots are intact")

    assert sorted(os.listdir(url)) == ["step-000000000010", "step-000000000020"]  # no torn step-30 left
    assert [item.step for item in store.list_snapshots()] == [10, 20]
    assert store.read_verified("step-000000000010")[1] == {"model": b"model at step 10"}
    assert store.latest_valid()[1] == {"model": b"model at step 20"}


def mapped_ranges(path):
    """The address ranges this process maps from the file at ``path`` (/proc/self/maps names its device and inode)."""
    stat = os.stat(path)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 5 and fields[3] == device and int(fields[4]) == stat.st_ino:
                start, end = (int(value, 16) for value in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def mapped_resident_kb(path):
    """kB of this process's maps of the file at ``path`` that are resident (/proc/self/smaps)."""
    stat = os.stat(path)
    device = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}"
    resident, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                inside = len(fields) >= 5 and fields[3] == device and int(fields[4]) == stat.st_ino
            elif inside and fields[0] == "Rss:":
                resident += int(fields[1])
    return resident


def test_a_local_stores_objects_are_read_once_into_memory_of_their_own_and_loaded_from_it(tmp_path):
    # A local object is read once into an in-memory file of this process (a memfd) and torch.load maps that: no
    # tensor lies in the snapshot's file itself (a tensor left in a tmpfs copy's pages would keep a pruned copy
    # in memory, and one cut short under it would fault). Views keep sharing their storage.
    torch = pytest.importorskip("torch")
    from elastictrain.snapshot.format import load_object, writer_for
    from elastictrain.storage.mapped import MappedFile

    weights = torch.arange(4096, dtype=torch.float32)
    state = {"moments": [weights * 2, (weights * 3)[10:20]], "step": 7}
    store = SnapshotStore(str(tmp_path / "snapshots"))
    manifest = store.commit(5, {"state.pt": writer_for(state), "empty": write_bytes(b"")}, meta={})
    _, payload = store.read_verified(manifest.snapshot_id)
    mapped = payload["state.pt"]
    assert isinstance(mapped, MappedFile) and payload["empty"] == b""
    # verified, its pages left the resident set: torch.load's own map would otherwise count them twice in RSS
    assert mapped_resident_kb(mapped.path) == 0
    path = object_path(store, 5, "state.pt")
    with open(path, "rb") as handle:
        assert bytes(mapped) == handle.read()
    loaded = load_object(mapped, "here")
    assert loaded["step"] == 7 and torch.equal(loaded["moments"][0], weights * 2)
    assert torch.equal(loaded["moments"][1], (weights * 3)[10:20])
    assert loaded["moments"][1].untyped_storage().nbytes() == 4096 * 4  # still a view of its whole storage
    in_file, in_copy = mapped_ranges(path), mapped_ranges(mapped.path)
    for tensor in loaded["moments"]:
        address = tensor.untyped_storage().data_ptr()
        assert not any(start <= address < end for start, end in in_file), "a loaded tensor lies in the file"
        assert any(start <= address < end for start, end in in_copy), "a loaded tensor was copied again"


def test_what_loads_is_what_was_verified_whatever_happens_to_the_file_after(tmp_path):
    # Between the checksum and torch.load the file may be written over in place (a bit flip; a recycled copy),
    # replaced or pruned: what loads is the bytes the checksum read, never the file as it is by then.
    torch = pytest.importorskip("torch")
    from elastictrain.snapshot.format import load_object, writer_for

    store = SnapshotStore(str(tmp_path / "snapshots"))
    manifest = store.commit(3, {"state.pt": writer_for({"x": torch.ones(1024)})}, meta={})
    _, payload = store.read_verified(manifest.snapshot_id)
    path = object_path(store, 3, "state.pt")
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:  # every byte of the data written over, in place
        handle.seek(size // 2)
        handle.write(b"\xff" * 64)
    assert torch.equal(load_object(payload["state.pt"], "here")["x"], torch.ones(1024))
    with open(path, "r+b") as handle:
        handle.truncate(100)  # cut short
    assert torch.equal(load_object(payload["state.pt"], "here")["x"], torch.ones(1024))
    other = tmp_path / "other.pt"
    with open(other, "wb") as handle:
        writer_for({"x": torch.zeros(1024)})(handle)
    os.replace(other, path)  # a new file under the old name
    assert torch.equal(load_object(payload["state.pt"], "here")["x"], torch.ones(1024))
    os.unlink(path)
    assert torch.equal(load_object(payload["state.pt"], "here")["x"], torch.ones(1024))


def test_a_local_objects_read_is_retried_while_the_filesystem_does_not_answer(tmp_path, monkeypatch):
    # A local store's objects are read into memory by mapped.py, through the store's one retry path: a network
    # filesystem timing out (ETIMEDOUT) is retried until it answers, as every other store call is.
    from elastictrain.storage import catalog

    store = SnapshotStore(str(tmp_path / "snapshots"), retry_for_s=5.0)
    manifest = commit_small(store, 4)
    real, failures = catalog.map_file, []

    def flaky(path):
        if len(failures) < 2:
            failures.append(path)
            raise OSError(errno.ETIMEDOUT, "timed out", path)
        return real(path)

    monkeypatch.setattr(catalog, "map_file", flaky)
    assert store.read_verified(manifest.snapshot_id)[1] == {"model": b"model at step 4"}
    assert len(failures) == 2

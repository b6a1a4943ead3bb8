"""`elastictrain snapshots ...` and `elastictrain plot` as a user runs them: real snapshots, real subprocesses.

The snapshots come from a small real training run on local disk; every command runs as
`python -m elastictrain ...` in its own process and is judged by its output and exit code.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from elastictrain import Trainer, seed_everything
from elastictrain.snapshot.format import MODEL_OBJECT, STATE_OBJECT, load_object, writer_for
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals
from tests.conftest import REPO_ROOT
from tests.helpers.corrupt import flip_middle_byte

TASK = {"train_samples": 512, "val_samples": 128, "hidden": 32}
SNAPSHOT_STEPS = [40, 60, 80, 96]  # every 20 steps, the final one at 96 (3 epochs of 32), keep 4


def train_into(url: str) -> None:
    seed_everything(0)
    Trainer.from_task(spirals.build(**TASK), {
        "run": {"name": "cli-test"},
        "snapshot": {"durable": {"url": url, "every_steps": 20, "keep_last": 4}},
        "train": {"max_epochs": 3, "batch_size": 16, "log_every_steps": 5},
        "log": {"progress_bar": False, "plots": False},
    }).fit()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    url = tmp_path_factory.mktemp("trained") / "snapshots"
    train_into(str(url))
    return url


@pytest.fixture
def store_dir(trained, tmp_path) -> Path:
    """A private copy of the trained store, for tests that corrupt or prune it."""
    return Path(shutil.copytree(trained, tmp_path / "snapshots"))


def elastictrain(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elastictrain", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=120,
    )


def snapshot_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def newest_state(root: Path, step: int) -> dict:
    return load_object((snapshot_dir(root, step) / STATE_OBJECT).read_bytes(), "test")


def assert_fits_80_columns(text: str) -> None:
    # Only a single word longer than the terminal (a long path or URL) may overflow.
    assert all(len(line) <= 80 or " " not in line.strip() for line in text.splitlines()), text


def words(text: str) -> str:
    """The text with line breaks and runs of spaces as single spaces: what a reader reads."""
    return " ".join(text.split())


def assert_one_error_line(done: subprocess.CompletedProcess, *expected: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("elastictrain: warning: ")]
    assert len(lines) == 1 and lines[0].startswith("elastictrain: error: "), done.stderr
    for text in expected:
        assert text in lines[0]


@pytest.mark.slow
def test_list_has_one_row_per_step_prefix_and_flags_a_torn_one(store_dir):
    torn = snapshot_dir(store_dir, 120)  # a write killed before its manifest
    torn.mkdir()
    (torn / MODEL_OBJECT).write_bytes(b"half a model")
    truncated = snapshot_dir(store_dir, 60) / STATE_OBJECT  # e.g. a disk that filled up under a copy
    truncated.write_bytes(truncated.read_bytes()[:1000])
    flip_middle_byte(snapshot_dir(store_dir, 80) / MODEL_OBJECT)  # sizes intact: the column does not claim more
    done = elastictrain("snapshots", "list", store_dir)
    assert done.returncode == 0, done.stderr
    assert_fits_80_columns(done.stdout)
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STEP"))
    assert lines[header].split() == ["STEP", "EPOCH", "CREATED", "SIZE", "WORLD", "SIZES"]
    rows = [line.split() for line in lines[header + 1:header + 2 + len(SNAPSHOT_STEPS)]]
    store = SnapshotStore(str(store_dir))
    for row, listing in zip(rows, store.list_snapshots(), strict=True):
        assert int(row[0]) == listing.step
        if listing.manifest is None:
            assert row[1:3] == ["-", "-"] and row[-1] == "BAD"
        elif listing.step == 60:
            assert row[-1] == "BAD"
        else:
            assert int(row[1]) == listing.manifest.meta["epoch"] and row[-2:] == ["1", "ok"]
    assert [int(row[0]) for row in rows] == [*SNAPSHOT_STEPS, 120]
    assert "step 120: no manifest (torn or in-progress write)" in done.stdout
    assert "step 60: object 'state.pt' is 1000 bytes, the manifest says" in done.stdout
    assert "checksums are not read" in words(done.stdout) and "snapshots verify` reads them" in words(done.stdout)

    document = json.loads(elastictrain("snapshots", "list", store_dir, "--json").stdout)
    by_step = {row["step"]: row for row in document["snapshots"]}
    assert sorted(by_step) == [*SNAPSHOT_STEPS, 120]
    assert [step for step, row in by_step.items() if not row["sizes_ok"]] == [60, 120]
    for listing in store.list_snapshots()[:-1]:
        row = by_step[listing.step]
        if listing.step == 60:
            continue
        assert row["sizes_ok"] and row["epoch"] == listing.manifest.meta["epoch"]
        assert row["size_bytes"] == sum(entry.size for entry in listing.manifest.objects.values())
        assert row["created_unix"] == listing.manifest.created_unix
    assert by_step[120]["sizes_ok"] is False and by_step[120]["size_bytes"] == len(b"half a model")
    assert "valid" not in by_step[80], "a row says what was checked: sizes, not checksums"


@pytest.mark.slow
def test_verify_exits_0_then_1_naming_a_corrupt_newest_snapshot(store_dir):
    done = elastictrain("snapshots", "verify", store_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("checksums match") == len(SNAPSHOT_STEPS)

    flip_middle_byte(snapshot_dir(store_dir, 96) / MODEL_OBJECT)
    done = elastictrain("snapshots", "verify", store_dir)
    assert done.returncode == 1
    assert_fits_80_columns(done.stdout)
    bad = [line.split() for line in done.stdout.splitlines() if "BAD" in line]
    assert bad == [["step", "96", "BAD"]]
    assert f"step 96 BAD snapshot {store_dir}/step-000000000096 is corrupt: object 'model.pt' xxh3_128 mismatch" in words(done.stdout)
    assert "a restore would fall back to step 80" in done.stdout
    assert_one_error_line(done, "newest snapshot", "(step 96) is invalid")


@pytest.mark.slow
def test_verify_exits_0_when_only_an_older_snapshot_is_corrupt(store_dir):
    flip_middle_byte(snapshot_dir(store_dir, 60) / STATE_OBJECT)
    done = elastictrain("snapshots", "verify", store_dir, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["invalid_steps"] == [60] and document["newest_valid"] is True
    assert [row["step"] for row in document["snapshots"] if row["valid"]] == [40, 80, 96]
    assert "'state.pt' xxh3_128 mismatch" in document["snapshots"][1]["problem"]


@pytest.mark.slow
def test_show_prints_the_newest_valid_snapshots_progress_config_and_history(trained):
    state = newest_state(trained, 96)
    records = state["history"]["records"]
    train = [r for r in records if "train_loss" in r]
    done = elastictrain("snapshots", "show", trained)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert_fits_80_columns(out)
    assert words(out).startswith(f"snapshot {trained}/step-000000000096 created ")
    assert "progress  step 96, epoch 3 (sample 0 of it), 1536 samples seen" in out
    assert "world     1 worker(s)" in out and "1,251 parameters" in out
    assert f"train_loss  {train[0]['train_loss']:.4f} at step {train[0]['step']} -> {train[-1]['train_loss']:.4f} at step 96" in out
    assert f"val_loss {state['history']['records'][-1]['val_loss']:.4f}" in out
    # Only the keys that differ from the defaults; --json has the whole config.
    assert re.search(r"\nconfig    \d+ key\(s\) differ from the defaults \(--json has the whole config\):\n", out), out
    for line in ("run.name = cli-test", "train.batch_size = 16", "snapshot.durable.every_steps = 20"):
        assert f"\n  {line}\n" in out
    assert "train.max_steps" not in out and "train.grad_accum_steps" not in out, "defaults are not listed"

    document = json.loads(elastictrain("snapshots", "show", trained, "--step", "60", "--json").stdout)
    older = newest_state(trained, 60)
    assert document["step"] == 60 and document["newest"] is False
    assert document["progress"] == older["progress"] and document["config"] == older["config"]
    assert document["history"]["records"] == len(older["history"]["records"])


@pytest.mark.slow
def test_show_counts_attempts_and_restarts_a_snapshot_records(store_dir):
    store = SnapshotStore(str(store_dir))
    state = newest_state(store_dir, 96)
    attempts = [
        {"restart_count": 0, "world_size": 2, "start_step": 0, "started_unix": 1.7e9, "launcher": "torchrun", "reason": "fresh"},
        {"restart_count": 1, "world_size": 2, "start_step": 40, "started_unix": 1.7e9 + 60, "launcher": "torchrun", "reason": "restart"},
        {"restart_count": 2, "world_size": 1, "start_step": 80, "started_unix": 1.7e9 + 90, "launcher": "torchrun", "reason": "restart"},
    ]
    model = (snapshot_dir(store_dir, 96) / MODEL_OBJECT).read_bytes()
    store.commit(100, {MODEL_OBJECT: lambda handle: handle.write(model),
                       STATE_OBJECT: writer_for({**state, "run_log": {"attempts": attempts}, "goodput": {"seconds_by_cause": {
                           "productive": 8.0, "snapshot": 0.5, "restore": 0.0, "recompute": 0.0, "evaluate": 0.0, "restart": 1.5}}})},
                 {"epoch": 3, "epoch_offset": 0, "world_size": 1, "format_version": 1})
    done = elastictrain("snapshots", "show", store_dir)
    assert done.returncode == 0, done.stderr
    assert "attempts  3 (2 restart(s))" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().startswith(("1 ", "2 ", "3 "))]
    assert [row[:4] for row in rows] == [["1", "0", "2", "0"], ["2", "1", "2", "40"], ["3", "2", "1", "80"]]
    assert "goodput   0.80 (8.0s productive of 10.0s; restart 1.5s, snapshot 0.5s)\n" in done.stdout
    document = json.loads(elastictrain("snapshots", "show", store_dir, "--json").stdout)
    assert document["restarts"] == 2 and document["attempts"] == attempts


@pytest.mark.slow
def test_export_writes_the_newest_valid_weights_that_torch_load_reads(store_dir, tmp_path):
    newest = tmp_path / "newest.pt"
    done = elastictrain("snapshots", "export", store_dir, "--out", newest, "--newest-or-fail")
    assert done.returncode == 0 and words(done.stdout).startswith(f"exported step 96: wrote {newest}"), done.stderr
    assert "not the newest" not in done.stdout

    flip_middle_byte(snapshot_dir(store_dir, 96) / STATE_OBJECT)  # the newest does not verify: step 80 is exported
    out = tmp_path / "weights.pt"
    done = elastictrain("snapshots", "export", store_dir, "--out", out)
    assert done.returncode == 0, done.stderr
    assert words(done.stdout).startswith(f"exported step 80: wrote {out} (torch,"), done.stdout
    assert "not the newest snapshot: step 96 does not verify" in words(done.stdout)
    assert "skipping snapshot" in done.stderr and "Traceback" not in done.stderr
    document = json.loads(elastictrain("snapshots", "export", store_dir, "--out", out, "--json").stdout)
    assert (document["step"], document["newest_step"], document["chosen_by"]) == (80, 96, "newest valid")

    refused = tmp_path / "refused.pt"
    done = elastictrain("snapshots", "export", store_dir, "--out", refused, "--newest-or-fail")
    assert_one_error_line(done, "step-000000000096", "--newest-or-fail exports nothing older")
    assert done.stdout == "" and not refused.exists()
    exported = torch.load(out, weights_only=True)
    expected = load_object((snapshot_dir(store_dir, 80) / MODEL_OBJECT).read_bytes(), "test")
    assert list(exported) == list(expected)
    assert all(torch.equal(exported[name], expected[name]) for name in expected)

    document = json.loads(elastictrain("snapshots", "export", store_dir, "--out", out, "--step", "40", "--json").stdout)
    assert document["step"] == 40 and document["tensors"] == len(expected)
    at_40 = load_object((snapshot_dir(store_dir, 40) / MODEL_OBJECT).read_bytes(), "test")
    assert all(torch.equal(torch.load(out, weights_only=True)[n], at_40[n]) for n in at_40)


@pytest.mark.slow
def test_prune_leaves_exactly_the_newest_n(store_dir):
    done = elastictrain("snapshots", "prune", store_dir, "--keep", "2")
    assert done.returncode == 0, done.stderr
    assert [s.step for s in SnapshotStore(str(store_dir)).list_snapshots()] == [80, 96]
    assert "deleted 2 snapshot(s)" in done.stdout and "remaining 2: step 80, 96" in words(done.stdout)


@pytest.mark.slow
def test_prune_never_deletes_the_newest_valid_snapshot(store_dir):
    flip_middle_byte(snapshot_dir(store_dir, 96) / MODEL_OBJECT)
    flip_middle_byte(snapshot_dir(store_dir, 80) / MODEL_OBJECT)
    done = elastictrain("snapshots", "prune", store_dir, "--keep", "1", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["remaining"] == [60, 80, 96] and document["deleted"] == [40]
    assert document["kept_for_newest_valid"] is True and document["newest_valid_step"] == 60


@pytest.mark.slow
def test_plot_draws_the_newest_valid_snapshots_history(trained, tmp_path):
    done = elastictrain("plot", trained, "--out", tmp_path / "plots")
    assert done.returncode == 0, done.stderr
    files = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert files == ["accuracy.png", "loss.png", "lr.png"]
    assert all((tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for name in files)
    assert words(done.stdout).startswith(f"plotted step 96 of {trained}:")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["snapshots", "list", "{missing}"], ["no such location: {missing}"]),
        (["snapshots", "show", "{empty}"], ["no snapshots under {empty}"]),
        (["snapshots", "show", "{store}", "--step", "7"], ["no snapshot at step 7", "steps there: 40, 60, 80, 96"]),
        (["snapshots", "export", "{store}", "--step", "96", "--out", "{tmp}/w.pt"], ["step-000000000096 is corrupt", "pick another with --step"]),
        (["snapshots", "export", "{store}", "--out", "{tmp}/no/such/dir/w.pt"], ["cannot write {tmp}/no/such/dir/w.pt"]),
        (["snapshots", "list", "{store}", "--storage-option", "anon"], ["--storage-option 'anon' is not KEY=VALUE"]),
        (["snapshots", "list", "nosuchproto://bucket/run"], ["cannot be opened"]),
        (["snapshots", "prune", "{store}", "--keep", "0"], ["--keep must be at least 1"]),
        (["snapshots", "list", "{tmp}"], ["no snapshots under {tmp}", "{tmp}/snapshots has 4: pass that URL"]),
        (["snapshots", "export", "{store}", "--step", "80", "--newest-or-fail", "--out", "{tmp}/w.pt"],
         ["--newest-or-fail and --step exclude each other"]),
    ],
    ids=["no-such-url", "no-snapshots", "no-such-step", "invalid-step", "unwritable-out", "bad-storage-option",
         "unknown-protocol", "keep-0", "run-dir-not-its-snapshots", "newest-or-fail-with-step"],
)
def test_user_mistakes_are_one_line_and_no_traceback(store_dir, tmp_path, args, expected):
    flip_middle_byte(snapshot_dir(store_dir, 96) / MODEL_OBJECT)
    (tmp_path / "empty").mkdir()
    names = {"store": store_dir, "missing": tmp_path / "missing", "empty": tmp_path / "empty", "tmp": tmp_path}
    done = elastictrain(*(arg.format(**names) for arg in args))
    assert_one_error_line(done, *(text.format(**names) for text in expected))
    assert done.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("args", [["snapshots", "prune", "{store}", "--keep", "0"], ["snapshots", "list", "{missing}"]],
                         ids=["keep-0", "no-such-url"])
def test_with_json_a_mistake_is_one_json_document_on_stdout_and_one_line_on_stderr(store_dir, tmp_path, args):
    done = elastictrain(*(arg.format(store=store_dir, missing=tmp_path / "missing") for arg in args), "--json")
    assert done.returncode == 1 and done.stderr.startswith("elastictrain: error: ") and done.stderr.count("\n") == 1
    document = json.loads(done.stdout)
    assert document == {"error": done.stderr.removeprefix("elastictrain: error: ").strip(), "exit_code": 1}


@pytest.mark.slow
def test_safetensors_export_is_one_clear_line_when_safetensors_is_missing(trained, tmp_path):
    try:
        import safetensors  # noqa: F401
    except ImportError:
        done = elastictrain("snapshots", "export", trained, "--out", tmp_path / "w.safetensors", "--format", "safetensors")
        assert_one_error_line(done, "needs the safetensors package", "pip install safetensors")
        assert not (tmp_path / "w.safetensors").exists()
    else:
        from safetensors.torch import load_file

        done = elastictrain("snapshots", "export", trained, "--out", tmp_path / "w.safetensors", "--format", "safetensors")
        assert done.returncode == 0, done.stderr
        expected = load_object((snapshot_dir(trained, 96) / MODEL_OBJECT).read_bytes(), "test")
        exported = load_file(tmp_path / "w.safetensors")
        assert all(torch.equal(exported[name], expected[name]) for name in expected)


@pytest.mark.slow
def test_memory_url_in_process(capsys):
    # memory:// lives in one process, so this one runs the command function in this process.
    from elastictrain.cli import main as cli

    url = f"memory://elastictrain-tests/{uuid.uuid4().hex}"
    train_into(url)
    capsys.readouterr()
    assert cli.main(["snapshots", "list", url, "--json"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)["snapshots"]] == SNAPSHOT_STEPS
    assert cli.main(["snapshots", "show", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["progress"]["global_step"] == 96


NO_TORCH = """
import sys, types
root = types.ModuleType("elastictrain"); root.__path__ = [{package!r}]
sys.modules["elastictrain"] = root  # the commands' own imports, whatever the package root imports
from elastictrain.cli import main as cli
code = cli.main(sys.argv[1:])
assert "torch" not in sys.modules, "torch was imported"
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", [["snapshots", "list"], ["snapshots", "verify"], ["snapshots", "prune", "--keep", "3"]])
def test_list_verify_and_prune_do_not_import_torch(trained, store_dir, command):
    script = NO_TORCH.format(package=str(REPO_ROOT / "elastictrain"))
    url = store_dir if "prune" in command else trained
    done = subprocess.run([sys.executable, "-c", script, *command[:2], str(url), *command[2:]],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_help_and_list_through_the_package_root_do_not_import_torch(trained):
    probe = subprocess.run([sys.executable, "-c", "import elastictrain, sys; print('torch' in sys.modules)"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False", "import elastictrain imported torch: the package root must stay lazy"
    for args in (["--help"], ["snapshots", "list", str(trained)]):
        done = subprocess.run([sys.executable, "-X", "importtime", "-m", "elastictrain", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0
        imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
        assert "torch" not in imported, args

"""Bad input gets one clear line, never a deep traceback; internal bugs keep their traceback.

Each case runs what the user runs: a training script of their own (handler API, in a subprocess,
so the uncaught error is printed by Python as the user would see it) or ``python -m elastictrain
train`` with their overrides.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from elastictrain.core.errors import LossFnError, SnapshotError
from elastictrain.dist.group import DistContext
from elastictrain.launcher.launch_env import LaunchEnv
from elastictrain.dist.reduce import WeightedSums
from elastictrain.snapshot.format import load_object
from elastictrain.train.task import Task, split_loss
from tests.conftest import REPO_ROOT, job_env, python_command

# A user's script, as the README shows it, small. LOSS picks what its loss_fn returns.
USER_SCRIPT = textwrap.dedent('''
    import sys
    from collections import OrderedDict

    import torch
    import torch.nn.functional as F
    from torch import nn

    from elastictrain import Trainer, seed_everything
    from elastictrain.train.tasks.spirals import make_spirals


    class CausalLMOutput(OrderedDict):
        """What a Hugging Face model returns (transformers.utils.ModelOutput is an OrderedDict with attributes)."""

        def __init__(self, loss, logits):
            super().__init__(loss=loss, logits=logits)
            self.loss, self.logits = loss, logits


    def loss_fn(model, batch):
        points, labels = batch
        logits = model(points)
        loss = F.cross_entropy(logits, labels)
        if LOSS == "per_sample_metric":
            return loss, {"accuracy": (logits.argmax(1) == labels).float()}
        if LOSS == "model_output":
            return CausalLMOutput(loss, logits)
        if LOSS == "bug":
            return loss / 0 if points.sum() > 1e9 else 1 / 0
        return loss, {"accuracy": (logits.argmax(1) == labels).float().mean()}


    LOSS = sys.argv[1]
    seed_everything(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trainer = Trainer(
        model, optimizer, make_spirals(256, classes=3, noise=0.15, seed=1), loss_fn,
        config={"run": {"name": "my-script"}, "train": {"max_steps": 4, "batch_size": 16},
                "snapshot": {"durable": {"every_steps": 0, "on_done": False}}, "log": {"plots": False}},
        overrides=sys.argv[2:],
    )
    print("summary:", trainer.fit().line())
''')


def run_user_script(tmp_path: Path, loss: str, *overrides: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(USER_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), loss, f"run.dir={tmp_path / 'run'}", *overrides],
        cwd=tmp_path, env={**os.environ, **job_env()}, capture_output=True, text=True, timeout=120,
    )


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_command([]), *args], cwd=REPO_ROOT, env={**os.environ, **job_env()},
        capture_output=True, text=True, timeout=120,
    )


# -- 4. errors that name the cause ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, expected",
    [
        ("per_sample_metric",
         "loss_fn returned metric 'accuracy' of shape (16,); metrics must be scalars, the mean over the batch: "
         "return {'accuracy': x.mean()}"),
        ("model_output",
         'loss_fn returned CausalLMOutput: loss_fn must return a scalar loss tensor, or (loss, {"name": scalar}); '
         "did you mean to return output.loss?"),
    ],
)
def test_what_loss_fn_returned_is_named_in_one_line(tmp_path, loss, expected):
    result = run_user_script(tmp_path, loss)
    assert result.returncode == 1
    # Met in fit(): the session's log line says it, where and when; Python's hook does not print it again.
    assert "Traceback" not in result.stderr and result.stderr.count(expected) == 1, result.stderr
    assert f" ERROR rank 0 stopped in state TRAIN at step 0: {expected}\n" in result.stderr, result.stderr


class Output:
    def __init__(self, loss):
        self.loss = loss


LOSS = torch.tensor(0.5)


@pytest.mark.parametrize(
    "returned, expected",
    [
        (torch.ones(4), "loss_fn returned a loss of shape (4,); the loss must be a scalar, the mean over the batch: "
                        "return loss.mean() (or reduction='mean' in the loss function)"),
        ((0.5, {}), "loss_fn returned a loss of type float; the loss must be a scalar tensor that backward() can reach "
                    "(the tensor itself, not loss.item() or a number)"),
        (0.5, 'loss_fn returned float: loss_fn must return a scalar loss tensor, or (loss, {"name": scalar}); '
              "return the loss tensor itself, not loss.item() or a number"),
        (None, 'loss_fn returned None: loss_fn must return a scalar loss tensor, or (loss, {"name": scalar}); '
               "does loss_fn end with a return statement?"),
        ({"loss": LOSS, "acc": 1.0}, 'loss_fn returned dict: loss_fn must return a scalar loss tensor, or '
                                     "(loss, {\"name\": scalar}); did you mean to return output['loss']?"),
        ((LOSS, torch.ones(3)), 'loss_fn returned a tuple (Tensor, Tensor): loss_fn must return a scalar loss '
                                'tensor, or (loss, {"name": scalar})'),
        (Output(None), 'loss_fn returned Output: loss_fn must return a scalar loss tensor, or (loss, {"name": scalar}); '
                       "did you mean to return output.loss? (it is None here: the model computes a loss only when "
                       "the batch holds labels)"),
        ((LOSS, {"acc": [0.5, 0.7]}), "loss_fn returned metric 'acc' of type list; metrics must be scalars, the mean "
                                      "over the batch: return {'acc': x.mean()}"),
        ((LOSS, {"loss": LOSS}), "loss_fn returned a metric named 'loss', which would hide the loss; rename the metric"),
    ],
)
def test_every_wrong_return_is_one_line_naming_it(returned, expected):
    with pytest.raises(LossFnError) as raised:
        split_loss(returned)
    assert str(raised.value) == expected


def test_one_element_values_of_any_shape_are_scalars():
    loss, metrics = split_loss((torch.ones(1, requires_grad=True), {"a": torch.ones(1, 1), "b": 3, "c": torch.ones(()).numpy()}))
    assert loss.shape == (1,) and set(metrics) == {"a", "b", "c"}


# -- 5. config errors from a script, loading errors that are not about the file --------------------------


@pytest.mark.slow
def test_a_config_error_in_a_script_is_one_line_and_exit_2(tmp_path):
    # Before: a 13-line traceback ending in this message, exit code 1.
    result = run_user_script(tmp_path, "ok", "train.bach_size=3")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "elastictrain: error: invalid config (config dict + overrides): unknown key 'train.bach_size' "
        "(did you mean 'train.batch_size'?)"
    ]
    assert result.stdout == ""


@pytest.mark.slow
def test_a_bug_in_loss_fn_keeps_its_traceback(tmp_path):
    result = run_user_script(tmp_path, "bug")
    assert result.returncode == 1
    assert result.stderr.count("Traceback (most recent call last)") == 1, result.stderr  # logged; not printed again
    # The traceback, logged by the session, is followed by its move to FAILED only.
    assert result.stderr.rstrip().splitlines()[-2:] == ["ZeroDivisionError: division by zero",
                                                        result.stderr.rstrip().splitlines()[-1]]
    assert result.stderr.rstrip().endswith("INFO state TRAIN -> FAILED at step 0"), result.stderr[-2000:]
    assert "elastictrain: error:" not in result.stderr


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-snapshot",))


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data, reason",
    [
        (saved({"w": torch.ones(3)})[:200], "PytorchStreamReader failed reading zip archive: failed finding central directory"),
        (b"", "EOFError"),
        (b"hello world this is not a torch file", "KeyError: 101"),
        (bytes(range(16)) + saved({"w": torch.ones(3)}), "unpickling failed: Unsupported operand 0"),
        (saved({"model": Exploit()}), "Trying to load unsupported GLOBAL posix.system"),
    ],
)
def test_files_that_are_not_snapshots_are_one_snapshot_error(tmp_path, monkeypatch, data, reason):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SnapshotError) as raised:
        load_object(data, "snapshot memory://x/step-1/state.pt")
    assert str(raised.value).startswith(f"snapshot memory://x/step-1/state.pt cannot be loaded safely ({reason}")
    assert not (tmp_path / "pwned-by-snapshot").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_error_while_loading_is_not_blamed_on_the_file():
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device") as raised:
        load_object(saved({"w": torch.ones(3)}), "snapshot memory://x/step-1/state.pt", map_location="cuda")
    assert not isinstance(raised.value, SnapshotError)


@pytest.mark.slow
def test_out_of_memory_while_loading_propagates_as_itself(tmp_path):
    # A real allocation failure: the loading process may map only 150 MB more than it has,
    # and the snapshot holds a 200 MB tensor.
    (tmp_path / "big.pt").write_bytes(saved({"w": torch.zeros(50_000_000)}))
    code = textwrap.dedent(f'''
        import resource, sys
        from elastictrain.snapshot.format import load_object
        data = open({str(tmp_path / "big.pt")!r}, "rb").read()
        mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + 150_000_000, resource.RLIM_INFINITY))
        try:
            load_object(data, "snapshot step-1")
        except Exception as exc:
            print(type(exc).__name__, str(exc).splitlines()[0])
    ''')
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, **job_env()}, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.startswith("RuntimeError [enforce fail at alloc_cpu.cpp"), result.stdout + result.stderr
    assert "DefaultCPUAllocator: can't allocate memory" in result.stdout


# -- 6. inputs that slip through -------------------------------------------------------------------


def build_with_a_bug(hidden: int = 8) -> Task:
    """A task factory with a bug of its own (not about its arguments)."""
    layers = None
    return layers + hidden


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.batch_size=[32"],
         "override 'train.batch_size=[32': the value of train.batch_size is not valid YAML (while parsing a flow "
         "sequence: expected ',' or ']', but got '<stream end>' at column 4); values are parsed as YAML (64, 1e-3, "
         "true, null, [1, 2], {a: 1}): fix it, or put it in quotes to pass a string"),
        (["--config", "conf"],
         "config file conf is a directory; pass a YAML file such as conf/default.yaml"),
        (["task.args.hidden=abc"],
         "task.args.hidden='abc' is a str, but elastictrain.train.tasks.spirals:build takes hidden: int; fix task.args.hidden"),
        (["task.args.lr=1e-3"],
         "task.args.lr='1e-3' is a str, but elastictrain.train.tasks.spirals:build takes lr: float; fix task.args.lr (YAML "
         "reads 1e-3 as text, not a number: write 0.001)"),
        (["task.args.hidden=-5"],
         "task.args do not fit elastictrain.train.tasks.spirals:build (given hidden=-5): ValueError: 'hidden' must be at "
         "least 1, got -5; fix task.args (for the traceback: ELASTICTRAIN_TRACEBACK=1)"),
        (["snapshot.durable.storage_options.key=AKIA0", "snapshot.durable.storage_options.secret=hunter2", "run.dir=/tmp/x"],
         "invalid config (defaults + overrides): snapshot.durable.storage_options (key, secret) are ignored for the local "
         "path snapshot.durable.url='/tmp/x/snapshots': they configure a remote store (credentials, endpoint); set "
         "snapshot.durable.url to the store they are for (e.g. s3://bucket/run) or remove them (snapshot.durable.storage_options={})"),
        (["train.virtual_shards=6"],
         "invalid config (defaults + overrides): train.virtual_shards=6 must be a power of two (2, 4, 8, ...): the "
         "shards' gradients are summed in one binary tree, the same at every world size; pick the power of two at "
         "least as large as the largest world size the job may have"),
    ],
    ids=["yaml-override", "config-dir", "factory-arg-type", "factory-arg-yaml-number", "factory-arg-range", "local-storage-options", "virtual-shards-not-a-power-of-two"],
)
def test_inputs_that_slipped_through_are_one_line_naming_the_key(tmp_path, args, expected):
    result = run_cli(tmp_path, *args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"elastictrain: error: {expected}"]
    assert "hunter2" not in result.stderr


@pytest.mark.slow
def test_a_bug_inside_a_task_factory_keeps_its_traceback(tmp_path):
    result = run_cli(tmp_path, "task.factory=tests.test_user_errors:build_with_a_bug", "task.args.hidden=8")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.rstrip().endswith("TypeError: unsupported operand type(s) for +: 'NoneType' and 'int'")
    assert "task.args do not fit" not in result.stderr


def test_one_element_values_are_summed_whatever_their_shape():
    sums = WeightedSums(torch.device("cpu"))
    sums.add(4, {"loss": torch.full((1,), 2.0), "accuracy": torch.tensor(0.5), "n": 1})
    sums.add(2, {"loss": torch.full((1, 1), 5.0), "accuracy": torch.tensor([1.0]), "n": 3})
    means, _ = sums.reduce(DistContext(LaunchEnv("none"), False, torch.device("cpu"), None, 300.0))
    # accuracy, loss, n: sample-weighted over 4 + 2 samples
    assert means == {"accuracy": (0.5 * 4 + 1.0 * 2) / 6, "loss": (2.0 * 4 + 5.0 * 2) / 6, "n": (1 * 4 + 3 * 2) / 6}


def test_metric_keys_that_change_between_steps_are_one_line_naming_them():
    # Before, a key added later was dropped without a word and a key left out later was a KeyError.
    sums = WeightedSums(torch.device("cpu"))
    sums.add(4, {"loss": torch.tensor(2.0), "accuracy": torch.tensor(0.5)})
    with pytest.raises(LossFnError, match=r"^loss_fn returned the metric keys \['accuracy', 'grad_norm', 'loss'\] after "
                                          r"\['accuracy', 'loss'\] in earlier steps; return the same keys at every step"):
        sums.add(4, {"loss": torch.tensor(2.0), "accuracy": torch.tensor(0.5), "grad_norm": torch.tensor(1.0)})
    with pytest.raises(LossFnError, match=r"^loss_fn returned the metric keys \['loss'\] after"):
        sums.add(4, {"loss": torch.tensor(2.0)})


def test_snapshot_documents_as_json_have_null_where_python_would_write_nan():
    import json

    from elastictrain.cli.main import strict_json

    document = {"history": [{"step": 1, "train_loss": float("nan"), "grad_norm": float("inf")}], "best": -float("inf"),
                "steps": (1, 2.5)}
    text = json.dumps(strict_json(document), allow_nan=False)  # before: NaN and Infinity, which strict parsers reject
    assert json.loads(text) == {"history": [{"step": 1, "train_loss": None, "grad_norm": None}], "best": None,
                                "steps": [1, 2.5]}


@pytest.mark.parametrize("per_step, configured, hint", [(2, 2, False), (2, 1, True)])
def test_a_step_after_too_few_micro_batches_names_the_elastic_policy_when_it_chose_them(per_step, configured, hint):
    from elastictrain.data.train_data import wrong_micro_batches

    message = str(wrong_micro_batches(1, per_step, configured))
    assert message.startswith(f"session.step() after 1 micro-batch(es) of the loader; a step takes {per_step} "
                              "(session.grad_accum_steps): call step() once per optimizer step")
    assert ("train.on_world_size_change=keep_global_batch): iterate loader.steps()" in message and
            "or set train.on_world_size_change=keep_rank_batch" in message) == hint, message


@pytest.mark.parametrize("exc, limit, kind, line", [
    (ValueError("a\n  b\tc"), None, False, "a b c"),
    (ValueError("a\n  b\tc"), None, True, "ValueError: a b c"),
    (KeyError(), None, False, "KeyError: no message"),
    (OSError("x" * 20), 10, False, "xxxxxxx..."),
    (OSError("x" * 10), 10, True, "OSError: xxxxxxxxxx"),
])
def test_an_exception_is_said_in_one_line(exc, limit, kind, line):
    from elastictrain.core.errors import one_line

    assert one_line(exc, limit, kind=kind) == line

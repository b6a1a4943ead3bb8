"""The custom-loop API in one process: misuse is one clear line, and a custom loop resumes bitwise.

No launcher: a plain ``with Session(...)`` in the test process, snapshots on memory://, tiny data.
"""

from __future__ import annotations

import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.core.errors import ConfigError, SnapshotError, UsageError
from elastictrain.train.session import Session


def config(tmp_path, **train) -> dict:
    return {
        "run": {"dir": str(tmp_path / "run")},
        "snapshot": {"durable": {"url": f"memory://session-api-tests/{uuid.uuid4().hex}", "every_steps": 4}},
        "train": {"max_epochs": 2, "batch_size": 8, "log_every_steps": 4, **train},
        "log": {"progress_bar": False, "plots": False},
    }


def points(samples: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 4, generator=generator), torch.randint(0, 2, (samples,), generator=generator))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def misuse(capsys, cfg: dict, body) -> str:
    """Run ``body(session)`` in a session; return the UsageError's message, checked to be the one line logged."""
    with pytest.raises(UsageError) as raised:
        with Session(cfg) as session:
            body(session)
    message = str(raised.value)
    err = capsys.readouterr().err
    assert "\n" not in message and "Traceback" not in err
    assert "ERROR rank 0 stopped in state " in err and message in err, err
    return message


def test_state_registered_after_restore_is_one_line(tmp_path, capsys):
    def body(session):
        model = mlp()
        session.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        session.loader(points())
        session.restore()
        session.register(scaler=torch.amp.GradScaler("cpu"))

    assert misuse(capsys, config(tmp_path), body) == (
        "session.register() after session.restore(): register everything that is state before restoring, "
        "or it would not be restored")


def test_a_step_before_restore_is_one_line(tmp_path, capsys):
    def body(session):
        model = mlp()
        session.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        session.loader(points())
        session.step(loss=1.0)

    assert misuse(capsys, config(tmp_path), body).startswith("session.step() before session.restore(): restore first")


def test_a_step_after_the_wrong_number_of_micro_batches_is_one_line(tmp_path, capsys):
    def body(session):
        _model, _optimizer, loader = set_up(session)
        for _inputs, _labels in loader:
            session.step()  # after one micro-batch; a step takes two

    assert misuse(capsys, config(tmp_path, grad_accum_steps=2), body) == (
        "session.step() after 1 micro-batch(es) of the loader; a step takes 2 (session.grad_accum_steps): "
        "call step() once per optimizer step")


def test_a_rank_that_skips_session_step_is_one_line_at_its_next_batch(tmp_path, capsys):
    # Under torchrun, `if session.is_main: session.step()` left the other ranks in mismatched collectives until the
    # watchdog's 30 s; the rank that skips step() now says so before it reads the next step's batches.
    def body(session):
        _model, _optimizer, loader = set_up(session)
        for _inputs, _labels in loader:
            pass

    assert misuse(capsys, config(tmp_path), body) == (
        "rank 0 asked the loader for the next step's micro-batches without session.step() after the 1 it took: call "
        "session.step() on every rank, once per optimizer step (a rank that skips it leaves the others waiting in a "
        "collective)")


def test_a_wrapped_model_that_is_not_registered_is_one_line(tmp_path, capsys):
    def body(session):
        model, other = mlp(), nn.Linear(4, 2)
        session.wrap(other)
        session.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        session.loader(points())
        session.restore()

    assert misuse(capsys, config(tmp_path), body).startswith(
        "a Linear wrapped by session.wrap() is not registered: session.register(name=model)")


def test_restore_without_a_model_is_one_line(tmp_path, capsys):
    def body(session):
        session.register(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1))
        session.loader(points())
        session.restore()

    assert misuse(capsys, config(tmp_path), body).startswith("session.restore() with no model registered")


def set_up(session, dataset=None, evaluate=None):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session.register(model=model, optimizer=optimizer)
    loader = session.loader(points() if dataset is None else dataset)
    if evaluate is not None:
        session.evaluate_with(evaluate)
    session.restore()
    return model, optimizer, loader


@pytest.mark.parametrize("case, expected", [
    ("a DataLoader", "the dataset given to session.loader() is a DataLoader; pass the Dataset it loads (its .dataset): "
                     "elastictrain builds the loader itself, sharded across ranks and resumable mid-epoch (batch size: "
                     "train.batch_size; a collate_fn: pass it too)"),
    ("an empty dataset", "the dataset given to session.loader() is empty: its Dataset has 0 samples; check what it "
                         "reads (a path, a filter, a split)"),
    ("evaluate returns a float", "the function given to session.evaluate_with() returned a float; it returns a dict of "
                                 "metric names to numbers, e.g. {'loss': 0.31, 'accuracy': 0.92}"),
    ("evaluate returns a vector", "the function given to session.evaluate_with() returned 'accuracy' as a Tensor of "
                                  "shape (4,); metrics are scalars: return {'accuracy': x.mean()}"),
    ("a per-sample loss", "session.step(loss=...) got a Tensor of shape (8,); logged values are scalars, the mean over "
                          "the step's samples: pass loss=x.mean()"),
    ("total_steps before loader", "session.total_steps is known once session.loader() has the training set (or "
                                  "train.max_steps is set): call session.loader() first"),
])
def test_mistakes_found_late_are_one_line_at_once(tmp_path, capsys, case, expected):
    def body(session):
        if case == "a DataLoader":
            set_up(session, torch.utils.data.DataLoader(points(), batch_size=8))
        elif case == "an empty dataset":
            set_up(session, points(0))
        elif case.startswith("evaluate returns"):
            result = 0.5 if case.endswith("float") else {"accuracy": torch.ones(4)}
            model, _, loader = set_up(session, evaluate=lambda: result)
            for inputs, labels in loader:  # an epoch: the evaluation at its end
                session.step(loss=F.cross_entropy(model(inputs), labels))
        elif case == "a per-sample loss":
            model, _, loader = set_up(session)
            inputs, labels = next(iter(loader))
            session.step(loss=F.cross_entropy(model(inputs), labels, reduction="none"))
        else:
            torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.SGD(mlp().parameters(), lr=0.1),
                                                       T_max=session.total_steps)

    assert misuse(capsys, config(tmp_path), body) == expected


def custom_loop(cfg: dict, fail_in_step: int | None = None, left_out: tuple[str, ...] = ()) -> Session:
    """A loop of one's own: noise from torch's RNG on the inputs, Adam, a scheduler stepped per step."""
    with Session(cfg) as session:
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
        wrapped = session.wrap(model)
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
        session.register(**{name: value for name, value in state.items() if name not in left_out})
        loader = session.loader(points())
        session.restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                loss = F.cross_entropy(wrapped(inputs + 0.1 * torch.randn_like(inputs)), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                if session.global_step + 1 == fail_in_step:
                    raise RuntimeError(f"a bug in step {fail_in_step}")
                session.step(loss=loss)
    return session


def test_a_custom_loop_killed_by_an_exception_resumes_bitwise_equal_to_an_unbroken_run(tmp_path):
    unbroken = custom_loop(config(tmp_path)).summary
    assert unbroken.state == "DONE" and unbroken.global_step == 2 * 64 // 8
    cfg = config(tmp_path)
    with pytest.raises(RuntimeError, match="a bug in step 11"):
        custom_loop(cfg, fail_in_step=11)
    resumed = custom_loop(cfg)
    assert resumed.run_log.attempts[-1]["start_step"] == 8  # the newest snapshot before the failure
    assert resumed.summary.attempts == 2 and resumed.summary.global_step == unbroken.global_step
    assert resumed.summary.params_sha256 == unbroken.params_sha256


def test_a_store_in_memory_under_torchrun_with_restarts_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Each torchrun restart is a new process: memory:// snapshots would be gone, every restart a fresh start."""
    from elastictrain.core.errors import ConfigError
    from tests.helpers.agents import free_port

    torchrun = {"TORCHELASTIC_RUN_ID": "memory-store", "TORCHELASTIC_RESTART_COUNT": "0", "RANK": "0",
                "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                "TORCHELASTIC_MAX_RESTARTS": "3"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    cfg = config(tmp_path)
    with pytest.raises(ConfigError) as raised:
        with Session(cfg):
            pass
    message = str(raised.value)
    assert message.startswith(f"snapshot.durable.url={cfg['snapshot']['durable']['url']} lives in this process's "
                              "memory, and torchrun restarts the workers as new processes (--max-restarts=3)")
    assert "\n" not in message and "Traceback" not in capsys.readouterr().err


def test_setup_seeds_every_generator_from_run_seed_whatever_came_before(tmp_path):
    """A loop builds its models inside the session: their initial weights are run.seed's on every rank and launch."""
    import random

    import numpy as np

    def first_draws(seed: int, before: int) -> tuple:
        random.seed(before), np.random.seed(before), torch.manual_seed(before)  # the process's state on entry
        cfg = config(tmp_path)
        cfg["run"]["seed"] = seed
        with Session(cfg) as session:
            draws = (random.random(), float(np.random.rand()), torch.rand(3).tolist(), mlp_unseeded().state_dict())
            session.register(model=nn.Linear(1, 1))  # a session left before restore: a warning, no error
        return draws

    def mlp_unseeded():
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    a, b, other = first_draws(7, before=1), first_draws(7, before=2), first_draws(8, before=1)
    assert a[:3] == b[:3] and a[:3] != other[:3]
    assert all(torch.equal(a[3][k], b[3][k]) for k in a[3]) and not torch.equal(a[3]["0.weight"], other[3]["0.weight"])
    torch.manual_seed(7)
    assert a[2] == torch.rand(3).tolist()  # torch.manual_seed(run.seed) itself: the Trainer's model init


@pytest.mark.parametrize("left_out, warning", [
    ((), None),
    (("scheduler",), "WARNING optimizer 'optimizer' is driven by a StepLR that is not registered; "
                     "session.register(lr_scheduler=...) it before restore(), or a resume restarts the schedule"),
    (("optimizer", "scheduler"), "WARNING model 'model': 4 of its 4 trainable parameters are in no registered "
                                 "optimizer (an unregistered Adam holds them);"),
])
def test_state_left_unregistered_is_one_warning_line_at_restore(tmp_path, capsys, left_out, warning):
    """A resume would silently lose it (an unbroken run never shows it): restore() says so, once, before training."""
    custom_loop(config(tmp_path, max_epochs=1), left_out=left_out)
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "not registered" in line or "no registered optimizer" in line]
    assert said == ([] if warning is None else [said[0]]) and (warning is None or warning in said[0]), err
    if warning:
        assert err.index(warning) < err.index("state RESTORE -> TRAIN")


def test_an_optimizer_of_another_class_than_the_snapshots_is_one_line_at_restore(tmp_path, capsys):
    cfg = config(tmp_path, max_steps=4)
    custom_loop(cfg)  # Adam's state in the snapshot
    capsys.readouterr()
    with pytest.raises(SnapshotError) as raised:
        with Session(cfg) as session:
            model = mlp()
            session.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
            session.loader(points())
            session.restore()
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in capsys.readouterr().err
    assert "('optimizer') was saved with an optimizer with the options amsgrad, betas, capturable, " in message
    assert "which this run's SGD does not have (it has dampening, momentum, nesterov): its state cannot be loaded; " \
           "use the optimizer the snapshot was taken with, or start fresh with snapshot.durable.url set to an empty " \
           "location" in message, message


def a_short_loop(cfg: dict) -> Session:
    with Session(cfg) as session:
        model, optimizer, loader = set_up(session)
        for _epoch in session.epochs():
            for inputs, labels in loader:
                loss = F.cross_entropy(model(inputs), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                session.step(loss=loss)
    return session


def test_a_run_dir_that_cannot_be_written_costs_a_finished_run_its_plots_only(tmp_path, capsys):
    """Snapshots elsewhere, run.dir under a regular file (no chmod: the tests run as root): the run ends DONE and the
    plots it cannot draw are one warning, not an exit 1 (under torchrun: restarts of a finished run)."""
    (tmp_path / "a-file").write_bytes(b"")
    cfg = config(tmp_path, max_steps=4)
    cfg["run"]["dir"] = str(tmp_path / "a-file" / "run")
    cfg["log"]["plots"] = True
    assert a_short_loop(cfg).summary.state == "DONE"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"WARNING no plots: {tmp_path}/a-file/run/plots cannot be written (Not a directory); point run.dir at a " \
           "writable directory, or set log.plots=false — the run finished and its snapshots are intact" in err, err


def test_a_run_dir_that_cannot_hold_the_snapshots_is_told_to_change_run_dir(tmp_path, capsys):
    """The durable store defaults to <run.dir>/snapshots: the key to change is run.dir, not snapshot.durable.url."""
    from elastictrain.core.errors import StorageError

    (tmp_path / "a-file").write_bytes(b"")
    cfg = config(tmp_path, max_steps=4)
    cfg["run"]["dir"] = str(tmp_path / "a-file" / "run")
    del cfg["snapshot"]["durable"]["url"]
    with pytest.raises(StorageError) as raised:
        a_short_loop(cfg)
    assert str(raised.value).endswith("is not writable (NotADirectoryError: [Errno 20] Not a directory: "
                                      f"'{tmp_path}/a-file/run'); check the path/credentials or set run.dir")


@pytest.mark.parametrize("call", ["session.epochs()", "iterating session.loader()'s loader", "session.step()",
                                  "session.restore()"])
def test_the_loop_dedented_out_of_the_with_block_is_one_line(tmp_path, capsys, call):
    """Found by a new user: the loop one indent too far left trained unseen in one process, and under torchrun met
    torch's "process group not initialized"."""
    with Session(config(tmp_path)) as session:
        model, optimizer, loader = set_up(session)
    with pytest.raises(UsageError) as raised:
        if call == "session.epochs()":
            next(iter(session.epochs()))
        elif call.startswith("iterating"):
            next(iter(loader))
        elif call == "session.step()":
            session.step(loss=torch.tensor(1.0))
        else:
            session.restore()
    assert str(raised.value) == (f"{call} after the `with Session(...)` block ended: indent the training loop inside "
                                 "`with Session(...) as session:`, where the session restores, steps and snapshots")
    assert session.rank == 0  # what a summary printed after the block asks still answers


def test_a_key_that_does_nothing_as_set_is_one_warning_at_restore(tmp_path, capsys):
    cfg = config(tmp_path, max_steps=4)
    cfg["snapshot"]["local"] = {"every_steps": 2}  # no snapshot.local.url: no fast tier to pace
    a_short_loop(cfg)
    err = capsys.readouterr().err
    assert err.count("these keys do nothing as set:") == 1
    assert "WARNING these keys do nothing as set: snapshot.local.every_steps=2 (needs snapshot.local.url: the fast " \
           "tier is off; set it to a node-local path such as /dev/shm)\n" in err, err


def uncaught(capsys, raised: pytest.ExceptionInfo) -> tuple[int, str]:
    """What the hook elastictrain installs as ``sys.excepthook`` on import does with ``raised`` left uncaught: exit
    code, stderr. (Called itself: an earlier test's process group may have left torch's wrapper around it.)"""
    from elastictrain.core import excepthook

    with pytest.raises(SystemExit) as exited:
        excepthook._print_user_error(raised.type, raised.value, raised.tb)
    return exited.value.code, capsys.readouterr().err


def test_a_misuse_left_uncaught_is_said_once_by_the_session_s_log_line(tmp_path, capsys):
    def body(session):
        model = mlp()
        session.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        session.loader(points())
        session.step(loss=1.0)

    with pytest.raises(UsageError) as raised:
        with Session(config(tmp_path)) as session:
            body(session)
    logged = capsys.readouterr().err
    code, printed = uncaught(capsys, raised)
    assert code == 2 and printed == "", printed  # the hook ends the script without saying it again
    assert logged.count(str(raised.value)) == 1, logged


def test_an_error_before_the_session_logs_is_said_once_by_the_hook(tmp_path, capsys):
    with pytest.raises(ConfigError) as raised:
        Session({"train": {"max_epoch": 1}})
    code, printed = uncaught(capsys, raised)
    assert (code, printed) == (2, "elastictrain: error: invalid config (config dict): unknown key 'train.max_epoch' "
                                  "(did you mean 'train.max_epochs'?)\n")

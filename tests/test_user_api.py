"""The API as a new user meets it: schedules that know the step count, and honest resumes of a changed run.

In process (one worker, real storage on memory://): what a user running ``python train.py`` gets.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from elastictrain import SnapshotError, Trainer, seed_everything
from elastictrain.core.errors import ConfigError
from elastictrain.storage.snapshot_store import SnapshotStore
from elastictrain.train.tasks import spirals

SMALL = {"train_samples": 512, "val_samples": 128, "hidden": 32}


def memory_url() -> str:
    return f"memory://elastictrain-api-tests/{uuid.uuid4().hex}"


def trainer(url: str, task_args: dict = SMALL, lr_scheduler="task", loss_fn=None, **train) -> Trainer:
    seed_everything(0)
    task = spirals.build(**task_args)
    if lr_scheduler != "task":
        task.lr_scheduler = lr_scheduler
    if loss_fn is not None:
        task.loss_fn = loss_fn
    return Trainer.from_task(task, {
        "snapshot": {"durable": {"url": url, "every_steps": 10}},
        "train": {"max_epochs": 2, "batch_size": 16, "log_every_steps": 5, **train},
        "log": {"progress_bar": False, "plots": False},
    })


@pytest.mark.slow
def test_a_scheduler_factory_gets_the_runs_step_count_after_setup():
    seen = []

    def cosine(optimizer, total_steps):
        seen.append(total_steps)
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)

    run = trainer(memory_url(), lr_scheduler=cosine, max_epochs=3)
    assert run.total_steps == 3 * 512 // 16 == 96  # known before fit, from the launch environment
    run.fit()
    assert seen == [96]
    assert run.task.optimizer.param_groups[0]["lr"] < 1e-9, "the cosine ended at zero on the last step"


def linear_decay(optimizer, total_steps):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1 - step / total_steps))


@pytest.mark.slow
def test_a_run_with_a_scheduler_factory_resumes_bitwise():
    """The factory is called again at the restart, after the restore: the schedule goes on where it was."""
    unbroken = trainer(memory_url(), lr_scheduler=linear_decay).fit()
    calls = 0

    def fails_in_step_31(model, batch):
        nonlocal calls
        calls += 1
        if calls == 31:
            raise RuntimeError("a bug in step 31")
        return spirals.cross_entropy_with_accuracy(model, batch)

    url = memory_url()
    with pytest.raises(RuntimeError, match="a bug in step 31"):
        trainer(url, lr_scheduler=linear_decay, loss_fn=fails_in_step_31).fit()
    resumed = trainer(url, lr_scheduler=linear_decay)
    assert resumed.fit().params_sha256 == unbroken.params_sha256
    assert resumed.run_log.attempts[-1]["start_step"] == 30 and resumed.task.optimizer.param_groups[0]["lr"] == 0.0


@pytest.mark.slow
def test_a_scheduler_factory_stepped_per_epoch_gets_the_epoch_count():
    seen = []
    run = trainer(memory_url(), lr_scheduler=lambda opt, n: seen.append(n) or torch.optim.lr_scheduler.StepLR(opt, n),
                  max_epochs=3, lr_scheduler_interval="epoch")
    assert run.scheduler_steps == 3
    run.fit()
    assert seen == [3]


@pytest.mark.slow
def test_a_resume_with_a_changed_harmless_key_says_what_changed_and_goes_on(capfd):
    url = memory_url()
    trainer(url, max_epochs=1).fit()
    resumed = trainer(url, max_epochs=2).fit()
    err = capfd.readouterr().err
    assert "was made with another config; resuming with this run's: train.max_epochs 1 -> 2" in err
    assert resumed.global_step == 64


@pytest.mark.slow
def test_a_resume_that_would_change_the_batch_geometry_is_refused_with_the_way_out(capfd):
    url = memory_url()
    trainer(url, max_steps=20).fit()
    before = [s.snapshot_id for s in SnapshotStore(url).list_snapshots()]
    with pytest.raises(SnapshotError, match=r"was made with train\.batch_size=16 \(this run: 32\).*"
                                            r"snapshot\.accept_changes=\[train\.batch_size\] — nothing was deleted"):
        trainer(url, batch_size=32).fit()
    assert [s.snapshot_id for s in SnapshotStore(url).list_snapshots()] == before
    capfd.readouterr()

    seed_everything(0)
    accepted = Trainer.from_task(spirals.build(**SMALL), {
        "snapshot": {"durable": {"url": url, "every_steps": 10}, "accept_changes": ["train.batch_size"]},
        "train": {"max_epochs": 2, "batch_size": 32, "log_every_steps": 5}, "log": {"progress_bar": False, "plots": False},
    }).fit()
    assert accepted.state == "DONE"
    assert "train.batch_size 16 -> 32" in capfd.readouterr().err


@pytest.mark.slow
def test_a_script_handing_over_a_dataset_of_another_size_is_refused():
    """A script's data are not in the config; their size is what the saved position counts in."""
    url = memory_url()
    trainer(url, max_steps=20).fit()
    with pytest.raises(SnapshotError, match=r"was made with train_data\.len=512 \(this run: 1024\)"):
        trainer(url, task_args={**SMALL, "train_samples": 1024}).fit()


@pytest.mark.slow
def test_an_optimizer_set_up_with_another_lr_in_the_script_is_warned_about(capfd):
    url = memory_url()
    trainer(url, max_steps=20).fit()
    capfd.readouterr()
    trainer(url, task_args={**SMALL, "lr": 1e-5}).fit()
    err = capfd.readouterr().err
    assert "the optimizer's hyperparameters differ from this run's (lr 0.003 -> 1e-05)" in err


def test_a_list_of_optimizers_is_refused_when_the_trainer_is_built():
    task = spirals.build(**SMALL)
    second = torch.optim.SGD(task.model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as caught:
        Trainer(task.model, [task.optimizer, second], task.train_data, task.loss_fn)
    assert str(caught.value) == (
        "optimizer is a list of 2; the Trainer steps one torch.optim.Optimizer: put the parameter groups in one "
        "optimizer (each group may have its own lr), or train the several optimizers in a custom loop"
    )


@pytest.mark.parametrize("mistake, expected", [
    ("train_data", "train_data is a DataLoader; pass the Dataset it loads (its .dataset): elastictrain builds the "
                   "loader itself, sharded across ranks and resumable mid-epoch (batch size: train.batch_size; a "
                   "collate_fn: pass it too)"),  # before: 'DataLoader' object is not subscriptable, 3 restarts
    ("val_data", "val_data is a DataLoader; pass the Dataset it loads (its .dataset): elastictrain builds the loader "
                 "itself, sharded across ranks and resumable mid-epoch (batch size: train.batch_size; a collate_fn: "
                 "pass it too)"),
    ("scheduler", "lr_scheduler test_mistakes_in_the_trainer_s_arguments_are_one_line_when_it_is_built.<locals>."
                  "<lambda>(optimizer) cannot be called as factory(optimizer, total_steps): a scheduler factory takes "
                  "both, e.g. lambda optimizer, total_steps: CosineAnnealingLR(optimizer, T_max=total_steps); or pass "
                  "a built scheduler"),  # before: a 31-line TypeError after the restore
])
def test_mistakes_in_the_trainer_s_arguments_are_one_line_when_it_is_built(mistake, expected):
    from elastictrain.core.errors import UsageError

    task = spirals.build(**SMALL)
    arguments = {"val_data": task.val_data, "lr_scheduler": None}
    train_data = task.train_data
    if mistake == "train_data":
        train_data = torch.utils.data.DataLoader(task.train_data, batch_size=16)
    elif mistake == "val_data":
        arguments["val_data"] = torch.utils.data.DataLoader(task.val_data, batch_size=16)
    else:
        arguments["lr_scheduler"] = lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 10)
    with pytest.raises(UsageError) as caught:
        Trainer(task.model, task.optimizer, train_data, task.loss_fn, **arguments)
    assert str(caught.value) == expected


def test_a_rollback_past_a_scheduled_lr_step_is_not_warned_about_as_a_changed_lr(monkeypatch):
    """Found by the chaos soak: a rollback restores into the running optimizer, whose lr a scheduler has moved since
    the snapshot; what the user chose (the starting lr) is the same, so no "start fresh" advice."""
    from elastictrain.snapshot import resume_checks
    from elastictrain.core.config_load import load_config

    cfg = load_config({"run": {"dir": "/tmp/a-run"}})
    said = []
    monkeypatch.setattr(resume_checks.log, "warning", lambda *args: said.append(args[0] % args[1:]))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    saved = {"param_groups": [dict(group, params=[]) for group in optimizer.state_dict()["param_groups"]]}
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    resume_checks.warn_on_changed_hyperparameters(optimizer, saved, "snapshot s", cfg)
    assert said == []

    chosen = torch.optim.AdamW(model.parameters(), lr=1e-5)  # another lr in the script, under a scheduler too
    torch.optim.lr_scheduler.StepLR(chosen, step_size=1, gamma=0.5)
    resume_checks.warn_on_changed_hyperparameters(chosen, saved, "snapshot s", cfg)
    assert len(said) == 1 and "(lr 0.003 -> 1e-05)" in said[0], said
    # With run.dir set, another run.name resumes the same snapshots again: the advice names the key that works.
    assert "start fresh with another run.dir (snapshots go to /tmp/a-run/snapshots) to train with the new ones" \
        in said[0], said


def test_an_optimizer_state_is_refused_only_when_this_optimizer_cannot_take_it():
    """Keys one side only has are a torch version's new options (accepted); keys differing both ways are another
    class, and another number of parameter groups cannot load either."""
    from elastictrain.snapshot import resume_checks
    from elastictrain.core.config_load import load_config

    cfg = load_config()
    model = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    older_torch = sgd.state_dict()
    older_torch["param_groups"][0].pop("fused")  # an option a later torch added
    resume_checks.check_optimizer_fits(sgd, older_torch, "snapshot s", cfg)
    with pytest.raises(SnapshotError, match=r"^snapshot s was saved with an optimizer with the options amsgrad, betas, "
                                            r"capturable, decoupled_weight_decay, eps, which this run's SGD does not "
                                            r"have \(it has dampening, momentum, nesterov\): its state cannot be loaded"):
        resume_checks.check_optimizer_fits(sgd, torch.optim.Adam(model.parameters()).state_dict(), "snapshot s", cfg)
    two_groups = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1, momentum=0.9)
    with pytest.raises(SnapshotError, match=r"^snapshot s was saved with 1 parameter group\(s\), this run's SGD has 2"):
        resume_checks.check_optimizer_fits(two_groups, sgd.state_dict(), "snapshot s", cfg)

"""Self-healing in one process: what a rollback decides (``judge``, table-tested), spikes, the skip list, and
a custom loop healed in-process, bitwise, with no launcher (memory:// snapshots, tiny data)."""

from __future__ import annotations

import hashlib
import math
import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.health.anomaly_text import of_ranks, where
from elastictrain.health.anomaly_state import AnomalyLog, GradNormStatistic, Sighting, judge
from elastictrain.data.sampling import Shard, ShardedBatchSampler, epoch_order
from elastictrain.core.errors import AnomalyError
from elastictrain.train.session import Session
from elastictrain.health.update_check import Finding, decide_update, finding_of

NAN, INF = float("nan"), float("inf")


def seen(step, value=NAN, kind="gradient norm", own_loss=False):
    return Sighting(step, value, kind, "host", own_loss=own_loss)


@pytest.mark.parametrize(
    "sightings, replaying, rollbacks, expected",
    [
        # every rank saw the all-reduced NaN: replay it
        ([seen(9), seen(9)], None, 0, ("rollback", 9, (0, 1), ())),
        # rank 1's own loss was non-finite first: the origin
        ([seen(9), seen(9, own_loss=True)], None, 0, ("rollback", 9, (0, 1), (1,))),
        # a fault on rank 1 only (after the all-reduce): the others saw nothing
        ([None, seen(9, INF)], None, 0, ("rollback", 9, (1,), ())),
        # the earliest step is the anomaly; a later one on another rank follows from it
        ([seen(11), seen(9, INF)], None, 0, ("rollback", 9, (1,), ())),
        # the replay met it again at the same step: the data
        ([seen(9), seen(9)], 9, 1, ("data", 9, (0, 1), ())),
        # ... in one rank's gradients only, which the all-reduce makes equal: that rank's hardware
        ([None, seen(9, INF)], 9, 1, ("fault", 9, (1,), ())),
        # ... on one rank, whose own loss was non-finite: the data (that rank's samples)
        ([None, seen(9, NAN, "loss", True)], 9, 1, ("data", 9, (1,), (1,))),
        # ... at another step: a new anomaly, replayed in turn
        ([seen(7), None], 9, 1, ("rollback", 7, (0,), ())),
        # only a loss was seen (a custom loop without gradients_ok): still a rollback
        ([seen(9, NAN, "loss", True), None], None, 0, ("rollback", 9, (0,), (0,))),
        # the budget is spent: stop, whatever it was
        ([seen(9), seen(9)], 9, 4, ("stop", 9, (0, 1), ())),
        ([seen(9), seen(9)], None, 4, ("stop", 9, (0, 1), ())),
    ],
)
def test_judge(sightings, replaying, rollbacks, expected):
    verdict = judge(sightings, replaying, rollbacks, budget=4)
    assert (verdict.action, verdict.step, verdict.ranks, verdict.origin) == expected


def test_judge_prefers_the_agreed_gradient_norm_to_a_ranks_own_loss():
    verdict = judge([seen(5, 3.0, "loss", True), seen(5, 123.0)], None, 0, 4)
    assert (verdict.kind, verdict.value) == ("gradient norm", 123.0)


def test_a_loss_anomaly_names_the_ranks_whose_loss_was_non_finite_not_those_its_nan_reached():
    # Rank 0's loss was NaN at a snapshot step; the all-reduce carried it into rank 1's weights, which the check
    # before the snapshot saw. The line must name rank 0 alone: operators replace a host named twice.
    verdict = judge([seen(10, NAN, "loss", own_loss=True), seen(10, NAN, "weights")], None, 0, budget=4)
    assert (verdict.kind, verdict.ranks, verdict.origin) == ("loss", (0, 1), (0,))
    assert where(verdict.kind, verdict.ranks, verdict.origin, ["node-a", "node-b"], 2) == " on rank(s) 0 (host node-a)"
    assert where("loss", (1,), (1,), ["node-a", "node-b"], 2) == " on rank(s) 1 (host node-b)"
    assert where("weights", (0, 1), (), ["node-a", "node-a"], 2) == " on rank(s) 0, 1 (host node-a)"
    assert where("gradient norm", (1,), (), ["node-a", "node-b"], 2) == " on rank(s) 1 (host node-b) only"
    assert where("loss", (0,), (0,), ["node-a"], 1) == ""


GRAD_INF, LOSS_NAN = Finding("gradient norm", INF, host="b"), Finding("loss", NAN, own_loss=True, host="a")


@pytest.mark.parametrize(
    "norm, spike, loss, expected",
    [
        (None, False, None, None),  # nothing read, no loss: nothing to find
        (1.5, False, 2.0, None),
        (INF, False, None, ("gradient norm", False, False)),
        (NAN, False, 2.0, ("gradient norm", False, False)),
        (9.0, True, None, ("gradient norm", True, False)),  # a finite spike
        (None, False, NAN, ("loss", False, True)),  # the norm not read: this rank's own loss still counts
        (1.5, False, INF, ("loss", False, True)),
        (NAN, False, NAN, ("gradient norm", False, True)),  # the norm first, its origin kept
    ],
)
def test_finding_of(norm, spike, loss, expected):
    found = finding_of(norm, spike, loss)
    assert (found if found is None else (found.kind, found.spike, found.own_loss)) == expected


@pytest.mark.parametrize(
    "findings, expected",
    [
        ([None, None], (True, (), None, ())),
        # a fault in rank 1's gradients after the all-reduce: rank 0 saw nothing, and holds its update too
        ([None, GRAD_INF], (False, (1,), "gradient norm", ())),
        # rank 0's own loss was NaN, the norm not read: every rank holds its update
        ([LOSS_NAN, None], (False, (0,), "loss", (0,))),
        # the norm is reported before a rank's loss; the loss names the origin
        ([LOSS_NAN, GRAD_INF], (False, (0, 1), "gradient norm", (0,))),
        ([None], (True, (), None, ())),
    ],
)
def test_decide_update_is_the_same_on_every_rank_from_every_ranks_finding(findings, expected):
    decision = decide_update(findings)
    assert (decision.take, decision.ranks, decision.found and decision.found.kind, decision.origin) == expected


def test_a_spike_is_judged_against_the_running_mean_after_warm_up_only():
    stats = GradNormStatistic()
    for _ in range(3):
        assert not stats.is_spike(0, 100.0, factor=5.0, warmup_steps=3)  # warming up: nothing is a spike
        stats.update(0, 1.0, window=10)
    assert stats.means == [1.0] and stats.counts == [3]
    assert not stats.is_spike(0, 4.9, factor=5.0, warmup_steps=3)
    assert stats.is_spike(0, 5.1, factor=5.0, warmup_steps=3)
    assert not stats.is_spike(0, 5.1, factor=0.0, warmup_steps=3)  # spike_factor 0: off
    assert not stats.is_spike(1, 5.1, factor=5.0, warmup_steps=3)  # a second check of the step has its own mean
    again = GradNormStatistic()
    again.load_state_dict(stats.state_dict())
    assert again.is_spike(0, 5.1, factor=5.0, warmup_steps=3), "restored with the snapshot: judged the same"


def test_a_steps_samples_of_some_ranks_follow_the_samplers_layout():
    # 2 micro-batches x 2 ranks x 3 samples: rank 0 takes positions 0-2 and 6-8, rank 1 3-5 and 9-11.
    samples = list(range(100, 112))
    assert of_ranks(samples, (1,), world_size=2, rank_batch=3) == [103, 104, 105, 109, 110, 111]
    assert of_ranks(samples, (), world_size=2, rank_batch=3) == samples  # no origin: the whole step
    assert of_ranks(samples, (0, 1), world_size=2, rank_batch=3) == samples
    shard = Shard(rank=1, world_size=2, batch_size=3, grad_accum_steps=2)
    sampler = ShardedBatchSampler(12, shard, seed=0, epoch=0, offset=0, shuffle=False)
    assert [i for batch in sampler for i in batch] == [3, 4, 5, 9, 10, 11], "the layout of_ranks reads"


def test_skipped_samples_leave_the_order_and_the_rest_keeps_its_positions():
    order = epoch_order(64, seed=0, epoch=0, shuffle=True)
    skip = set(order[16:24])
    sampler = ShardedBatchSampler(64, Shard(0, 1, 8), seed=0, epoch=0, offset=0, shuffle=True, skip=skip)
    assert sampler.order == order[:16] + order[24:] and sampler.steps == 7
    resumed = ShardedBatchSampler(64, Shard(0, 1, 8), seed=0, epoch=0, offset=16, shuffle=True, skip=skip)
    assert list(resumed)[0] == order[24:32], "a position past the skipped ones continues after them"


def test_the_anomaly_log_keeps_what_it_learned_and_the_preset_list_apart():
    record = AnomalyLog(skip_samples=[3])
    record.skipped_samples.update({7, 8})
    record.add(step=5, decision="data", samples=[7, 8])
    again = AnomalyLog(skip_samples=[3])
    held = again.skipped_samples
    again.load_state_dict(record.state_dict())
    assert record.state_dict()["skipped_samples"] == [7, 8], "the preset list is config, not learned state"
    assert again.skipped_samples is held and held == {3, 7, 8}, "loaded in place: the sampler holds this set"
    assert again.counts["data"] == 1 and again.rollbacks == 1


def test_a_replay_under_way_is_in_the_snapshot_and_an_attempt_restarted_mid_replay_concludes_it(tmp_path):
    # A preemption or a lost peer between a rollback and its replayed step: the next attempt restores a snapshot
    # taken after the rollback and must still watch that step, and say what it was when it passes.
    from types import SimpleNamespace

    from elastictrain.core.config import AnomalyConfig
    from elastictrain.health.anomalies import Anomalies
    from elastictrain.health.anomaly_state import Verdict

    ctx = SimpleNamespace(is_main=True, world_size=2)
    first = Anomalies(AnomalyConfig(), AnomalyLog(), GradNormStatistic())
    first.attach(ctx, None)
    first.rolled_back(Verdict("rollback", 600, (0,), math.inf, "gradient norm"), None, restored_step=573)
    torch.save(first.record.state_dict(), tmp_path / "state.pt")  # as a snapshot saves it, read as a restore does

    restarted = Anomalies(AnomalyConfig(), AnomalyLog(), GradNormStatistic())
    restarted.attach(ctx, None)
    restarted.record.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert restarted.replaying == 600 and restarted.verifying(600) and not restarted.verifying(599)
    assert restarted.due(599, fast_tier=True).local_snapshot, "a copy of the step before, should it recur"
    restarted.replayed_clean(600)
    assert [(e["step"], e["decision"]) for e in restarted.record.entries] == [(600, "rollback"), (600, "transient")]
    assert restarted.replaying is None and restarted.record.state_dict()["replay"] is None


# -- in one process -------------------------------------------------------------------------------


def config(tmp_path, **anomaly) -> dict:
    return {
        "run": {"dir": str(tmp_path / "run")},
        "snapshot": {"durable": {"url": f"memory://anomaly-tests/{uuid.uuid4().hex}", "every_steps": 4}},
        "train": {"max_epochs": 2, "batch_size": 8, "log_every_steps": 4},
        "anomaly": anomaly,
        "log": {"progress_bar": False, "plots": False},
    }


def points(poison: int | None = None) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(64, 4, generator=generator), torch.randint(0, 2, (64,), generator=generator)
    if poison is not None:
        inputs[poison] = NAN
    return TensorDataset(inputs, labels)


def custom_loop(cfg: dict, data: TensorDataset, lr: float = 0.01) -> tuple[str, Session]:
    with Session(cfg) as session:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 2))  # dropout: the RNG replays too
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(data)
        session.restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                loss = F.cross_entropy(model(inputs), labels)
                loss.backward()
                if session.gradients_ok():
                    optimizer.step()
                optimizer.zero_grad()
                session.step(loss=loss.detach())
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return digest, session


ORDER = epoch_order(64, seed=0, epoch=0, shuffle=True)
POISON = ORDER[43]  # in step 6 (8 samples a step); snapshots every 4 steps


def test_a_rollback_in_process_skips_the_poisoned_steps_samples_and_ends_as_a_run_given_them(tmp_path, caplog):
    healed, session = custom_loop(config(tmp_path), points(POISON))
    record = session._state.anomalies
    assert sorted(record.skipped_samples) == sorted(ORDER[40:48]) and POISON in record.skipped_samples
    assert [(e["step"], e["decision"], e["rolled_back_to"]) for e in record.entries] == [(6, "rollback", 4), (6, "data", 5)]
    assert session.global_step == 14, "one step fewer in epoch 0: 56 samples left, 7 steps"
    reference, given = custom_loop(config(tmp_path, skip_samples=sorted(ORDER[40:48])), points(POISON))
    assert healed == reference
    # The running gradient norms are training state too: restored by the rollback, not counted twice.
    assert session._state.grad_norms.state_dict() == given._state.grad_norms.state_dict()
    unbroken, _ = custom_loop(config(tmp_path), points())
    assert healed != unbroken


def test_skip_drops_the_update_and_records_the_steps_samples(tmp_path):
    digest, session = custom_loop(config(tmp_path, policy="skip"), points(POISON))
    entries = session._state.anomalies.entries
    second = epoch_order(64, seed=0, epoch=1, shuffle=True).index(POISON) // 8  # skip lists nothing: it comes back
    assert [(e["step"], e["decision"]) for e in entries] == [(6, "skip"), (8 + second + 1, "skip")]
    assert sorted(entries[0]["samples"]) == sorted(ORDER[40:48]) and all(POISON in e["samples"] for e in entries)
    assert session.global_step == 16 and math.isfinite(session.summary.train_loss)
    assert not session._state.anomalies.skipped_samples, "skip trains on: it lists, it does not leave samples out"


def test_with_anomalies_off_a_nan_trains_on_into_the_weights(tmp_path):
    _, session = custom_loop(config(tmp_path, policy="off"), points(POISON))
    assert not session._state.anomalies.entries
    assert any(not torch.isfinite(p).all() for p in session.registered("model").parameters())


def test_a_spike_over_the_running_mean_is_rolled_back_and_found_to_be_data(tmp_path):
    inputs, labels = (t.clone() for t in points().tensors)
    inputs[POISON] *= 1e4  # finite, labelled against what the model says: its gradient is thousands of times the others'
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 2)).eval()  # custom_loop's model
    labels[POISON] = initial(inputs[POISON]).argmin()
    _, session = custom_loop(config(tmp_path, spike_factor=5.0, warmup_steps=3), TensorDataset(inputs, labels))
    assert [(e["step"], e["decision"]) for e in session._state.anomalies.entries] == [(6, "rollback"), (6, "data")]
    assert all(math.isfinite(e["value"]) and e["value"] > 5 for e in session._state.anomalies.entries)
    assert POISON in session._state.anomalies.skipped_samples


def test_an_anomaly_before_the_first_snapshot_stops_with_one_line(tmp_path, capsys):
    with pytest.raises(AnomalyError) as raised:
        custom_loop(config(tmp_path), points(ORDER[3]))  # step 1; the first snapshot is step 4's
    message = str(raised.value)
    assert message == ("anomaly at step 1 (loss nan) and no snapshot to roll back to yet: training stopped; "
                       "take snapshots more often (snapshot.durable.every_steps, or a fast tier: snapshot.local.url "
                       "with snapshot.local.every_steps), or set anomaly.policy=skip")
    assert "Traceback" not in capsys.readouterr().err


def test_a_trainer_with_a_grad_scaler_skips_a_spike_and_its_scaler_goes_on(tmp_path):
    from elastictrain import Trainer

    inputs, labels = (t.clone() for t in points().tensors)
    inputs[POISON] *= 1e4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 2))
    labels[POISON] = model.eval()(inputs[POISON]).argmin()
    model.train()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), TensorDataset(inputs, labels),
                      lambda m, batch: F.cross_entropy(m(batch[0]), batch[1]), grad_scaler=scaler,
                      config=config(tmp_path, policy="skip", spike_factor=5.0, warmup_steps=3))
    trainer.fit()  # a scaler left unscaled by the skipped step would refuse the next step's unscale_()
    entries = trainer.session._state.anomalies.entries
    assert [(e["step"], e["decision"]) for e in entries][:1] == [(6, "skip")]
    assert trainer.session.global_step == 16
    assert scaler.get_scale() == 2.0 ** 4, "the skip leaves the scale (and its growth count) alone"


@pytest.mark.parametrize("loss_to_check", [False, True])
def test_a_loop_without_a_loader_puts_the_recurring_step_itself_on_the_skip_list(tmp_path, loss_to_check):
    cfg = config(tmp_path)
    cfg["train"]["max_steps"] = 12
    with Session(cfg) as session:  # an RL-like loop: each step's inputs come from its step number
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        session.register(model=model, optimizer=optimizer)
        session.restore()
        updates = []
        while not session.done:
            step = session.global_step + 1
            inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            if step == 6:
                inputs[0] = NAN
            loss = model(inputs).pow(2).mean()
            loss.backward()
            if session.gradients_ok(loss=loss.detach()) if loss_to_check else session.gradients_ok():
                optimizer.step()
                updates.append(step)
            optimizer.zero_grad()
            session.step(loss=loss.detach())
    record = session._state.anomalies
    assert record.skipped_steps == {6} and not record.skipped_samples
    assert [(e["step"], e["decision"]) for e in record.entries] == [(6, "rollback"), (6, "data")]
    if loss_to_check:  # gradients_ok(loss=) sees the NaN loss before the update: step 6's is never taken
        assert updates == [1, 2, 3, 4, 5, 5, 7, 8, 9, 10, 11, 12]
    else:  # its loss is read after the update: step 6's bad update is taken, then rolled back (found, replayed)
        assert updates == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10, 11, 12]
    # After the verdict the run goes on from step 5's copy and step 6 takes no update.
    assert all(torch.isfinite(p).all() for p in model.parameters())


def clipped_loop(tmp_path, policy: str, clip_in_config: bool, clip_by_hand: bool) -> str:
    """custom_loop's model on SGD; ``train.clip_grad_norm`` for gradients_ok() to apply, or clip_grad_norm_ by hand."""
    cfg = config(tmp_path, policy=policy)
    cfg["train"]["clip_grad_norm"] = 0.05 if clip_in_config else None
    with Session(cfg) as session:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.1), nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(points())
        session.restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                loss = F.cross_entropy(model(inputs), labels)
                loss.backward()
                if clip_by_hand:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                if session.gradients_ok(loss=loss.detach()):
                    optimizer.step()
                optimizer.zero_grad()
                session.step(loss=loss.detach())
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def test_gradients_ok_clips_to_train_clip_grad_norm_bitwise_as_clip_grad_norm_does(tmp_path):
    by_hand = clipped_loop(tmp_path, "rollback", clip_in_config=False, clip_by_hand=True)
    assert clipped_loop(tmp_path, "rollback", clip_in_config=True, clip_by_hand=False) == by_hand
    assert clipped_loop(tmp_path, "skip", clip_in_config=True, clip_by_hand=False) == by_hand  # the norm checked too
    assert clipped_loop(tmp_path, "off", clip_in_config=True, clip_by_hand=False) == by_hand  # whatever the checks
    assert clipped_loop(tmp_path, "rollback", clip_in_config=False, clip_by_hand=False) != by_hand, "0.05 clips"


def test_a_scaler_told_of_another_ranks_overflow_ends_as_one_that_saw_it():
    # StepRunner under a GradScaler: a rank whose gradients were finite while another rank's were not (a fault
    # after the all-reduce) must skip and back off as that rank's scaler does, or the replicas and scales part.
    from elastictrain.train.step_runner import backed_off

    def scaler_after(gradient: float) -> tuple[dict, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
        for step in range(3):  # two finite steps counted towards growth, then the step in question
            scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            if step == 2:
                model.weight.grad[0, 0] = gradient
            scaler.unscale_(optimizer)
            if step == 2 and gradient != INF:
                backed_off(scaler)
            else:
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.unscale_(optimizer)  # the next step's unscale_ is allowed: the skipped one was forgotten
        return scaler.state_dict(), model.weight.detach().clone()

    saw_it, told = scaler_after(INF), scaler_after(1.0)
    assert told[0] == saw_it[0] and saw_it[0]["scale"] == 2.0 ** 7 and saw_it[0]["_growth_tracker"] == 0
    assert torch.equal(told[1], saw_it[1]), "neither took the update"


def _update_answers(rank: int, port: int, policy: str, results) -> None:
    import torch.distributed as tdist

    from elastictrain.core.config import AnomalyConfig
    from elastictrain.dist.group import DistContext
    from elastictrain.health.anomalies import Anomalies
    from elastictrain.launcher.launch_env import LaunchEnv

    store = tdist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    tdist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        ctx = DistContext(LaunchEnv("env", rank=rank, world_size=2), True, torch.device("cpu"), "gloo", 60.0)
        anomalies = Anomalies(AnomalyConfig(policy=policy), AnomalyLog(), GradNormStatistic())
        anomalies.attach(ctx, None)
        answer = anomalies.gradients_ok(None, 1, loss=torch.tensor(NAN if rank == 1 else 1.0))
        if policy == "rollback":  # rank 0 asks twice more, alone: a collective in it would pair with the one below
            more = [anomalies.gradients_ok(None, step, loss=torch.tensor(1.0)) for step in (2, 3)]
            assert more == [True, True]
        total = torch.tensor([float(rank + 1)])
        tdist.all_reduce(total)  # 1 + 2 when every earlier collective was made by both ranks
        pending = anomalies.pending
        results.put((rank, answer, float(total), pending.kind if pending is not None else None))
    finally:
        tdist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("policy, answers", [("skip", {0: False, 1: False}), ("rollback", {0: True, 1: False})])
def test_under_skip_every_rank_gets_one_answer_and_under_rollback_each_its_own_without_a_collective(policy, answers):
    from tests.helpers import ranks
    from tests.helpers.agents import free_port

    out = {rank: rest for rank, *rest in ranks.run(_update_answers, 2, free_port(), policy)}
    assert {rank: answer for rank, (answer, _, _) in out.items()} == answers
    assert all(total == 3.0 for _, total, _ in out.values()), out
    if policy == "rollback":  # the rank that holds its update raised a sighting: the vote rolls every rank back
        assert out[1][2] == "loss" and out[0][2] is None, out


def test_a_custom_loops_loss_handed_to_gradients_ok_and_to_step_is_read_once_and_a_nan_still_holds_the_update():
    # session.gradients_ok(loss=loss) then session.step(loss=loss): the same object for the same step is one host
    # read (on an accelerator, one wait for the device), not two; another object or another step is read again.
    from types import SimpleNamespace

    from elastictrain.core.config import AnomalyConfig
    from elastictrain.health.anomalies import Anomalies

    class Loss:
        def __init__(self, value: float) -> None:
            self.value, self.reads = value, 0

        def __float__(self) -> float:
            self.reads += 1
            return self.value

    anomalies = Anomalies(AnomalyConfig(), AnomalyLog(), GradNormStatistic())
    anomalies.attach(SimpleNamespace(is_main=True, world_size=1, distributed=False), None)
    loss = Loss(1.0)
    assert anomalies.gradients_ok(None, 1, loss=loss)
    anomalies.loss(loss, 1)
    assert loss.reads == 1
    anomalies.loss(loss, 2)
    anomalies.loss(Loss(1.0), 2)
    assert loss.reads == 2
    bad = Loss(math.nan)
    assert not anomalies.gradients_ok(None, 3, loss=bad)
    anomalies.loss(bad, 3)
    assert bad.reads == 1 and anomalies.pending is not None and anomalies.pending.step == 3


def test_a_loss_that_requires_grad_is_read_without_a_warning_and_not_kept_alive():
    # The custom loop hands the loss tensor itself (it requires grad): reading its value must not warn the user, and
    # the read-once record must not keep the last step's loss (and what its graph holds) alive.
    import gc
    import warnings
    import weakref
    from types import SimpleNamespace

    from elastictrain.core.config import AnomalyConfig
    from elastictrain.health.anomalies import Anomalies

    anomalies = Anomalies(AnomalyConfig(), AnomalyLog(), GradNormStatistic())
    anomalies.attach(SimpleNamespace(is_main=True, world_size=1, distributed=False), None)
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert anomalies.gradients_ok(None, 1, loss=loss)
        anomalies.loss(loss, 1)
        anomalies.loss(float("nan"), 2)  # a plain number is read too
    assert anomalies.pending is not None and anomalies.pending.step == 2
    gone = weakref.ref(loss)
    del loss
    gc.collect()
    assert gone() is None

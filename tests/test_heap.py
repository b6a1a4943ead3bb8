"""The garbage collector while a run trains: start-up's heap frozen (core/heap.py), and a restore that leaves no
reference cycle behind it to be frozen with it (what its frames held would live as long as the process).

One process, no launcher: ``with Session(...)`` on a memory:// store, tiny data.
"""

from __future__ import annotations

import gc
import types
import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from elastictrain.train.session import Session


def config(tmp_path, url: str) -> dict:
    return {
        "run": {"dir": str(tmp_path / "run")},
        "snapshot": {"durable": {"url": url, "every_steps": 4}},
        "train": {"max_epochs": 1, "batch_size": 8, "log_every_steps": 4},
        "log": {"progress_bar": False, "plots": False},
    }


def points() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 4, generator=generator), torch.randint(0, 2, (64,), generator=generator))


def train(cfg: dict, in_loop=lambda: None, before_restore=lambda: None, after_restore=lambda: None) -> None:
    with Session(cfg) as session:
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        session.register(model=model, optimizer=optimizer)
        loader = session.loader(points())
        before_restore()
        session.restore()
        after_restore()
        for _epoch in session.epochs():
            for inputs, labels in loader:
                loss = F.cross_entropy(model(inputs), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                in_loop()
                session.step(loss=loss)


@pytest.fixture
def collector():
    """The test process's collector as it was, whatever a test did to it."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    gc.set_debug(0)
    (gc.enable if enabled else gc.disable)()


def is_collected(obj: object) -> bool:
    """Whether the collector's passes visit ``obj`` (a frozen object is in none of its generations)."""
    return any(o is obj for o in gc.get_objects())


def test_training_runs_with_start_up_s_heap_frozen_and_the_session_s_end_gives_it_back(tmp_path, collector):
    built_before = [object()]  # a container: the collector tracks it
    seen = []
    train(config(tmp_path, f"memory://heap/{uuid.uuid4().hex}"),
          in_loop=lambda: seen.append((gc.get_freeze_count(), is_collected(built_before))))
    assert seen and all(count > 0 and not visited for count, visited in seen), seen[:3]
    assert gc.get_freeze_count() == 0 and is_collected(built_before)


@pytest.mark.parametrize("manages", ["gc.disable()", "gc.freeze() of its own"])
def test_a_process_that_manages_its_collector_is_left_alone(tmp_path, collector, manages):
    if manages == "gc.disable()":
        gc.disable()
    else:
        gc.freeze()
    frozen = gc.get_freeze_count()
    seen = []
    train(config(tmp_path, f"memory://heap/{uuid.uuid4().hex}"), in_loop=lambda: seen.append(gc.get_freeze_count()))
    # Frozen objects still die by reference counting: the count may fall; a freeze of the session's would add start-up's
    # heap, a release would empty it.
    assert seen and max(seen) <= frozen and 0 < gc.get_freeze_count() <= frozen if frozen else set(seen) == {0}
    assert gc.isenabled() == (manages != "gc.disable()")


def test_a_restore_leaves_no_reference_cycle_that_holds_frames_or_tensors(tmp_path, collector):
    """A resumed run's restore (the store's calls, the watchdog's heartbeats) makes no cyclic garbage that holds a
    frame or a tensor: frozen with start-up's heap, a frame's locals would never be freed."""
    cfg = config(tmp_path, f"memory://heap/{uuid.uuid4().hex}")
    train(cfg)  # the snapshots to resume from

    def before_restore():
        gc.collect()  # what start-up left, and the first session
        gc.disable()  # the collector managed here: the session freezes nothing, and nothing is collected before
        gc.set_debug(gc.DEBUG_SAVEALL)

    garbage: list = []

    def after_restore():
        gc.collect()
        garbage.extend(gc.garbage)
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()

    train({**cfg, "train": {**cfg["train"], "max_epochs": 2}}, before_restore=before_restore, after_restore=after_restore)
    frames = sorted({f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_code.co_name}"
                     for f in garbage if isinstance(f, types.FrameType)})
    tensors = [t for t in garbage if isinstance(t, torch.Tensor)]
    assert not frames and not tensors, (frames, len(tensors))

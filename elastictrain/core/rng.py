"""A process's random number streams (python, numpy, torch CPU, and CUDA when used): capture, restore, seed.

Two forms of a capture: ``capture_rng`` holds tensors, the form a snapshot saves and
``torch.load(weights_only=True)`` reads back; ``capture_rng_compact`` holds bytes and ints,
pickled in microseconds where tensors take a tenth of a millisecond (a survivor slot, written
every step). ``rng_from_compact`` turns the second into the first; ``restore_rng`` loads it.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This rank's RNG states (python, numpy, torch CPU, and CUDA when used) in loadable types."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def capture_rng_compact(device: torch.device) -> dict[str, Any]:
    """``capture_rng``'s states as bytes and ints (``rng_from_compact`` turns them back)."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": (
            numpy_state["state"]["key"].tobytes(),
            int(numpy_state["state"]["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["gauss"]),
        ),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return state


def rng_from_compact(state: dict[str, Any]) -> dict[str, Any]:
    """Back to ``capture_rng``'s form, which ``restore_rng`` loads."""
    key, pos, has_gauss, gauss = state["numpy"]
    restored = {
        "python": state["python"],
        "numpy": {
            "key": torch.from_numpy(np.frombuffer(key, dtype=np.uint32).astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "torch": torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8),
    }
    if "cuda" in state:
        restored["cuda"] = torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8)
    return restored


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Put back the streams ``capture_rng`` took (CUDA's only on a CUDA device)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            # On CUDA the state object is loaded onto the device (the optimizer's tensors belong there): RNG states come back.
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def seed_rng(seed: int) -> None:
    """Seed every stream of this process from ``seed`` (CUDA's on every device too): ``elastictrain.seed_everything``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_cpu_rng(seed: int) -> None:
    """Seed the CPU streams from a 64-bit ``seed`` (numpy from its high 32 bits), leaving CUDA's alone.

    torch.default_generator, not torch.manual_seed: that also seeds every CUDA device, whose
    streams drive the training process's dropout on a GPU.
    """
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed >> 32)


class KeptCpuRng:
    """The CPU streams (torch, random, numpy), put back as they were on exit."""

    def __enter__(self) -> None:
        self.torch, self.random, self.numpy = torch.get_rng_state(), random.getstate(), np.random.get_state()

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.torch)
        random.setstate(self.random)
        np.random.set_state(self.numpy)

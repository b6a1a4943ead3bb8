"""A process's random number streams (python, numpy, torch CPU, and CUDA when used): capture, restore, seed.

Two forms of a capture: ``capture_rng`` holds tensors, the form a snapshot saves and
``torch.load(weights_only=True)`` reads back; ``capture_rng_compact`` holds bytes and ints,
taken and pickled in about 5 microseconds (a survivor slot, written every step).
``rng_from_compact`` turns the second into the first; ``restore_rng`` loads it.
"""

from __future__ import annotations

import ctypes
import random
import struct
from array import array
from typing import Any, Generic, TypeVar

import numpy as np
import torch

Located = TypeVar("Located")
Compact = TypeVar("Compact")


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
    state = {
        "python": _PYTHON.compact(),
        "numpy": _NUMPY.compact(),
        "torch": torch.get_rng_state().numpy().tobytes(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    return state


def rng_from_compact(state: dict[str, Any]) -> dict[str, Any]:
    """Back to ``capture_rng``'s form, which ``restore_rng`` loads."""
    key, pos, has_gauss, gauss = state["numpy"]
    version, internal, gauss_next = state["python"]
    restored = {
        "python": (version, tuple(array("I", internal)), gauss_next),
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


class _ReadFromMemory(Generic[Located, Compact]):
    """A global stream's state read straight from its object's memory, where that place was found once and proven
    against the stream's own API; read through that API (slower) where it was not."""

    def __init__(self) -> None:
        self._searched = False
        self._located: Located | None = None  # where the state is, once proven

    def compact(self) -> Compact:
        if not self._searched:
            self._searched = True  # before _locate: its proof reads through compact()
            self._located = self._locate()
        return self._from_api() if self._located is None else self._read(self._located)

    def _read(self, located: Located) -> Compact:
        raise NotImplementedError

    def _from_api(self) -> Compact:
        raise NotImplementedError

    def _locate(self) -> Located | None:
        """Find the state, set ``_located`` and prove that ``compact()`` equals ``_from_api()``; None where it fails."""
        raise NotImplementedError


class _NumpyGlobalStream(_ReadFromMemory[tuple[int, int], tuple[bytes, int, int, float]]):
    """numpy's global stream (the RandomState behind ``np.random.*``) as (key bytes, pos, has_gauss, gauss).

    ``np.random.get_state`` builds a dict around a copy of the key: 30 us, most of a survivor mark.
    The same values are read from memory in 1 us: the MT19937 key and position at the bit
    generator's ctypes address, has_gauss and gauss in the RandomState's own struct beside the
    pointer it keeps back to its bit generator. That place is found once and proven with two
    set_state round trips (the stream is put back as it was); where the proof fails (another
    numpy's layout, or no ctypes interface), get_state is used.
    """

    _KEY = 624 * 4  # MT19937's key, then its position (int32)
    _AUG = struct.Struct("<xxxxxxxxixxxxd")  # after the pointer to the bit generator: has_gauss (int32), gauss

    def _read(self, located: tuple[int, int]) -> tuple[bytes, int, int, float]:
        state_address, aug_address = located
        raw = ctypes.string_at(state_address, self._KEY + 4)
        has_gauss, gauss = self._AUG.unpack(ctypes.string_at(aug_address, self._AUG.size))
        return raw[: self._KEY], int.from_bytes(raw[self._KEY :], "little", signed=True), has_gauss, gauss

    def _from_api(self) -> tuple[bytes, int, int, float]:
        numpy_state = np.random.get_state(legacy=False)
        return (
            numpy_state["state"]["key"].tobytes(),
            int(numpy_state["state"]["pos"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["gauss"]),
        )

    def _locate(self) -> tuple[int, int] | None:
        try:
            legacy = np.random.mtrand._rand
            state_address = int(legacy._bit_generator.ctypes.state_address)
            words = ctypes.string_at(id(legacy), type(legacy).__basicsize__)
        except (AttributeError, TypeError, ValueError):
            return None
        offsets = range(0, len(words) - 7, 8)
        found = [o for o in offsets if int.from_bytes(words[o : o + 8], "little") == state_address]
        if len(found) != 1:
            return None
        bitgen = id(legacy) + found[0]  # the bitgen_t, whose first field is the state's address
        aug = [o for o in offsets if int.from_bytes(words[o : o + 8], "little") == bitgen]
        if len(aug) != 1 or aug[0] + self._AUG.size > len(words):
            return None
        self._located = located = (state_address, id(legacy) + aug[0])
        before = np.random.get_state(legacy=False)
        try:
            for probe in ((1, 0.123456789), (0, -2.5)):
                np.random.set_state({**before, "has_gauss": probe[0], "gauss": probe[1]})
                if self.compact() != self._from_api():
                    return None
        finally:
            np.random.set_state(before)
        return located


class _PythonGlobalStream(_ReadFromMemory[int, tuple[int, bytes, float | None]]):
    """Python's global stream (the ``random.Random`` behind ``random.*``) as (version, its 625 words as bytes, gauss_next).

    ``random.getstate`` builds a tuple of 625 ints (6 us) that take 9 us more to turn into bytes; the same
    words are read from the object's memory in under 1 us: the Mersenne Twister's 624-word state and its index
    just before it. Where they are is found once, by the bytes getstate gives, and proven after a draw; where the
    proof fails, getstate is used.
    """

    _WORDS = 624 * 4

    def _read(self, located: int) -> tuple[int, bytes, float | None]:
        raw = ctypes.string_at(located, 4 + self._WORDS)  # the index, then the state
        return random.Random.VERSION, raw[4:] + raw[:4], random._inst.gauss_next  # type: ignore[attr-defined]

    def _from_api(self) -> tuple[int, bytes, float | None]:
        version, internal, gauss_next = random.getstate()
        return version, array("I", internal).tobytes(), gauss_next

    def _locate(self) -> int | None:
        instance = random._inst
        before = random.getstate()
        try:
            version, words, _ = self._from_api()
            memory = ctypes.string_at(id(instance), type(instance).__basicsize__)
            offset = memory.find(words[: self._WORDS])
            if version != random.Random.VERSION or offset < 4 or memory.find(words[: self._WORDS], offset + 1) != -1:
                return None
            self._located = id(instance) + offset - 4
            for _ in range(2):  # the index and the state move with each draw; the proof follows them
                if self.compact() != self._from_api():
                    return None
                random.random()
            return self._located
        except (AttributeError, TypeError, ValueError):
            return None
        finally:
            random.setstate(before)


_NUMPY = _NumpyGlobalStream()
_PYTHON = _PythonGlobalStream()


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

"""The numeric thread configuration, pinned wherever bits are promised.

On a CPU the bits of a float result depend on how many threads split a reduction and on
whether the runtime picks its threads and its schedule while it runs. torch's wheels use
OpenMP for their own kernels and MKL for matrix products, and out of the box MKL runs with
dynamic threads on and its deterministic scheduling (CNR) off (``MKL_VERBOSE=1`` shows
``CNR:OFF Dyn:1``); torchrun sets ``OMP_NUM_THREADS=1`` for more than one worker per node
but not for one, so the same run gets 1 or 2 threads by how it was launched.

``ThreadPin`` holds all of it still for the whole run:

- the intra-op thread count: the run's own, recorded at its first start (or
  ``train.intra_op_threads=N``), set again at every start and world size;
- MKL's and OpenMP's dynamic thread choice off, MKL's deterministic scheduling on
  (``MKL_CBWR=AUTO``, set by ``prepare_environment`` when elastictrain is imported, since MKL
  reads it at its first call);
- the CPU's kernel set (ATen's dispatch level) recorded, and a resume on another one named:
  that is the one condition left to the user (the same machine type).

It is a Stateful: the count travels in the snapshot, so a relaunch with another launcher,
world size or ``OMP_NUM_THREADS`` computes with the threads the run started with.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Literal

log = logging.getLogger("elastictrain")

# MKL's conditional numerical reproducibility: AUTO keeps this CPU's fastest code path and makes
# its schedule deterministic. MKL reads the variable once, at its first call.
MKL_CBWR = "AUTO"


def prepare_environment() -> None:
    """Ask MKL for deterministic scheduling before anything calls it (a user's MKL_CBWR wins)."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)


@dataclass(frozen=True)
class RuntimeThreads:
    """What the numeric runtime does now, as it reports it (None: not reported here)."""

    intra_op: int
    omp_dynamic: bool | None
    mkl_cnr: str | None  # MKL's reproducibility mode: OFF, AUTO, COMPATIBLE, AVX2, ...
    mkl_dynamic: bool | None
    cpu_capability: str  # ATen's kernel set on this CPU: DEFAULT, AVX2, AVX512, ...

    def line(self) -> str:
        parts = [f"{self.intra_op} intra-op thread{'s' if self.intra_op != 1 else ''}"]
        if self.mkl_cnr is not None:
            parts.append(f"MKL CNR {self.mkl_cnr}, dynamic {'on' if self.mkl_dynamic else 'off'}")
        if self.omp_dynamic is not None:
            parts.append(f"OpenMP dynamic {'on' if self.omp_dynamic else 'off'}")
        parts.append(f"{self.cpu_capability} kernels")
        return ", ".join(parts)


class ThreadPin:
    """Pins the thread configuration (``train.intra_op_threads``: auto, off or a count) and carries it in the snapshot."""

    def __init__(self, setting: int | Literal["auto", "off"] = "auto") -> None:
        self.setting = setting
        self.count: int | None = None  # the pinned intra-op count, once ``start`` ran
        self.origin = ""  # why this count: for the start-up line
        self._saved_capability: str | None = None

    @property
    def enabled(self) -> bool:
        return self.setting != "off"

    def start(self) -> None:
        """Before the first training step: dynamic threading off, this start's count pinned (RESTORE may change it)."""
        if not self.enabled:
            return
        import torch

        set_dynamic_off()
        if isinstance(self.setting, int):
            self.count, self.origin = self.setting, "train.intra_op_threads"
        else:
            self.count, self.origin = torch.get_num_threads(), "this start's, recorded for the run"
        torch.set_num_threads(self.count)

    # -- Stateful -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        import torch

        return {"intra_op_threads": torch.get_num_threads(), "cpu_capability": cpu_capability()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch

        saved = int(state["intra_op_threads"])
        self._saved_capability = state.get("cpu_capability")
        if self.setting == "auto":
            self.count, self.origin = saved, "the run's, recorded at its first start"
            torch.set_num_threads(saved)
        elif saved != torch.get_num_threads():  # pinned to another count by the user, or not pinned
            log.warning(
                "the snapshot was computed with %d intra-op threads, this worker has %d (train.intra_op_threads=%s): "
                "results go on but differ in the last bits from an unbroken run",
                saved,
                torch.get_num_threads(),
                self.setting,
            )

    # -- the start-up line ----------------------------------------------------------------

    def report(self) -> str:
        """One line: what is pinned, and what a bitwise resume still needs from the user."""
        now = probe()
        if not self.enabled:
            return (
                f"threads not pinned (train.intra_op_threads=off): {now.line()}; bitwise resumes need the same "
                "OMP_NUM_THREADS in every attempt"
            )
        line = f"threads pinned for bitwise results: {now.line()} (count: {self.origin})"
        if now.mkl_cnr == "OFF":
            line += (
                "; MKL ran before elastictrain was imported, so its scheduling stays dynamic: import elastictrain "
                "first, or set MKL_CBWR=AUTO"
            )
        if self._saved_capability and self._saved_capability != now.cpu_capability:
            line += (
                f"; the snapshot was computed with {self._saved_capability} kernels, this CPU runs "
                f"{now.cpu_capability}: results go on but differ in the last bits (bits need the same CPU type)"
            )
        return line


# -- the runtimes, through the symbols torch's libraries export ---------------------------------


def _torch_lib(name: str) -> ctypes.CDLL | None:
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", name)
    try:
        return ctypes.CDLL(path) if os.path.exists(path) else None  # already loaded: the same instance
    except OSError:
        return None


def _openmp() -> ctypes.CDLL | None:
    return _torch_lib("libgomp.so.1") or _torch_lib("libiomp5.so")


def _mkl() -> ctypes.CDLL | None:
    import torch

    lib = _torch_lib("libtorch_cpu.so") if torch.backends.mkl.is_available() else None
    return lib if lib is not None and hasattr(lib, "MKL_Set_Dynamic") else None


def set_dynamic_off() -> None:
    """OpenMP's and MKL's run-time choice of fewer threads off (this thread's OpenMP setting: the training thread)."""
    omp = _openmp()
    if omp is not None and hasattr(omp, "omp_set_dynamic"):
        omp.omp_set_dynamic(0)
    mkl = _mkl()
    if mkl is not None:
        # torch.set_num_threads does this too (torch 2.13); the C entry point (mkl_set_dynamic takes a pointer).
        mkl.MKL_Set_Dynamic(0)


def cpu_capability() -> str:
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except AttributeError:  # older torch
        return "unknown"


_VERBOSE = re.compile(rb"CNR:(\S+)\s+Dyn:(\d)")


def warm_up() -> None:
    """In the worker that forks the warm-start server, once: MKL's verbose mode times the CPU's clock the first
    time it reports (it waits for the wall clock's next whole second: 0 to 1 s), and every worker forked from the
    server inherits that instead of paying it before its start-up line (``probe``), which the other ranks
    wait for. One single-threaded 16x16 product: no thread pool is started before the forks."""
    _mkl_modes()


def probe() -> RuntimeThreads:
    """What the runtime does now; MKL's modes are read from its own verbose line for one tiny product."""
    import torch

    omp = _openmp()
    omp_dynamic = bool(omp.omp_get_dynamic()) if omp is not None and hasattr(omp, "omp_get_dynamic") else None
    cnr, mkl_dynamic = _mkl_modes()
    return RuntimeThreads(torch.get_num_threads(), omp_dynamic, cnr, mkl_dynamic, cpu_capability())


def _mkl_modes() -> tuple[str | None, bool | None]:
    """MKL reports its CNR mode only in its verbose output: turn it on for one 16x16 product written to a file."""
    import torch

    mkl = _mkl()
    if mkl is None or not hasattr(mkl, "MKL_Verbose"):
        return None, None
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved_stdout = os.dup(1)
    try:
        with tempfile.TemporaryFile() as out:
            os.dup2(out.fileno(), 1)
            try:
                mkl.MKL_Verbose(1)
                a = torch.ones(16, 16)
                torch.mm(a, a)
                mkl.MKL_Verbose(0)
                libc.fflush(None)
            finally:
                os.dup2(saved_stdout, 1)
            out.seek(0)
            found = _VERBOSE.search(out.read())
    finally:
        os.close(saved_stdout)
    if found is None:
        return None, None
    return found.group(1).decode(), found.group(2) == b"1"

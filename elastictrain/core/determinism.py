"""The determinism settings a CUDA run needs for bitwise resume, decided from the device and applied once.

On the CPU, bitwise resume needs the intra-op thread count pinned (threads.py); nothing here.
On CUDA it needs two more things, both process-wide:

- ``torch.use_deterministic_algorithms(True)``: kernels with no fixed reduction order (atomics in
  scatter/index_add backward, some convolution algorithms) are replaced by deterministic ones, or
  raise where torch has none, instead of differing in their last bits from run to run;
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS picks a reduction split from its workspace and the
  stream; a fixed workspace makes it fixed (NVIDIA's documented requirement, which
  ``use_deterministic_algorithms`` enforces). cuBLAS reads it when its handle is created, so it is
  set before the first CUDA operation; a value the user set already is kept.

``decide`` is pure (the device, the switch, the environment in; the settings out); ``apply`` does it
and returns the one start-up line that names them. ``dist.deterministic=false`` turns all of it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE = ":4096:8"  # 8 buffers of 4 MiB per stream (the other documented value, :16:8, is slower)


@dataclass(frozen=True)
class DeterminismSettings:
    """What ``apply`` sets: torch's deterministic algorithms, and the cuBLAS workspace (None: left as it is)."""

    deterministic_algorithms: bool
    cublas_workspace_config: str | None
    cublas_from_environment: bool  # the user's own value, kept

    def line(self) -> str:
        """The start-up line: what was set, and the key that turns it off."""
        if not self.deterministic_algorithms:
            return (
                "CUDA determinism off (dist.deterministic=false): torch's default kernels, cuBLAS's default "
                "workspace; a resume is not bitwise equal to an unbroken run"
            )
        whose = " (the environment's)" if self.cublas_from_environment else ""
        return (
            f"CUDA determinism for bitwise resume: torch.use_deterministic_algorithms(True), "
            f"{CUBLAS_VARIABLE}={self.cublas_workspace_config}{whose}; dist.deterministic=false turns both off"
        )


def decide(device: torch.device, enabled: bool, environ: Mapping[str, str]) -> DeterminismSettings | None:
    """The settings for a worker on ``device``: None on the CPU (nothing to set), else what ``apply`` sets."""
    if device.type != "cuda":
        return None
    if not enabled:
        return DeterminismSettings(False, None, False)
    given = environ.get(CUBLAS_VARIABLE)
    return DeterminismSettings(True, given or CUBLAS_WORKSPACE, bool(given))


def apply(settings: DeterminismSettings | None, environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set ``settings`` in this process (before its first CUDA operation); the start-up line, or None when none."""
    if settings is None:
        return None
    if settings.deterministic_algorithms:
        environ[CUBLAS_VARIABLE] = settings.cublas_workspace_config or CUBLAS_WORKSPACE
        torch.use_deterministic_algorithms(True)
    return settings.line()

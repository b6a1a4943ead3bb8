"""The devices and precisions the torchrun tests run on: the same test, another device.

A variant is data: the overrides that put the traced job (tests/helpers/jobs.py) on its device and in its
precision. ``param`` makes it a pytest parameter; a CUDA variant carries the ``cuda`` mark, which
tests/conftest.py skips where no GPU is present. Two ranks share one GPU with gloo (gloo reduces CUDA
tensors through the host), so one GPU runs every variant; NCCL needs a GPU per rank and is not exercised
here.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()

    @property
    def cuda(self) -> bool:
        return self.name.startswith("cuda")

    def param(self):
        return pytest.param(self, id=self.name, marks=[pytest.mark.cuda] if self.cuda else [])


# Both ranks on cuda:0 with gloo: what one GPU allows (NCCL refuses two ranks on one device).
ONE_GPU = ("dist.device=cuda:0", "dist.backend=gloo")
CPU = Variant("cpu")
CUDA_FP32 = Variant("cuda-fp32", ONE_GPU)
CUDA_BF16 = Variant("cuda-bf16", (*ONE_GPU, "train.autocast_dtype=bfloat16"))
CUDA_FP16 = Variant("cuda-fp16", (*ONE_GPU, "train.autocast_dtype=float16"))  # the loop adds a GradScaler
CUDA_VARIANTS = (CUDA_FP32, CUDA_BF16, CUDA_FP16)
ALL = (CPU, *CUDA_VARIANTS)

# What dist.setup logs on every CUDA rank 0 (elastictrain/core/determinism.py).
DETERMINISM_LINE = ("CUDA determinism for bitwise resume: torch.use_deterministic_algorithms(True), "
                    "CUBLAS_WORKSPACE_CONFIG=:4096:8; dist.deterministic=false turns both off")


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

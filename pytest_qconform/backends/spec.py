"""What a backend is asked to quantize to (``QuantSpec``): a record of its own, so that
both the backend interface (``base``) and the layer facet (``layers``) can name it
without importing each other; ``base`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_STORAGE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8"}


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize to. ``blocksize`` is the bnb block or the HQQ group size."""

    format: str  # "nf4" | "fp4" | "hqq4"
    blocksize: int = 64
    double_quant: bool = False
    axis: int = 1  # HQQ only
    # The dtype the packed bytes are stored as (bitsandbytes' ``quant_storage``: the same
    # bytes viewed as bf16/fp16/fp32, so FSDP can shard them with the other parameters).
    quant_storage: torch.dtype = torch.uint8

    def label(self) -> str:
        dq = "-dq" if self.double_quant else ""
        storage = "" if self.quant_storage == torch.uint8 else f"-s{_STORAGE_LABELS[self.quant_storage]}"
        return f"{self.format}-b{self.blocksize}{dq}{storage}"

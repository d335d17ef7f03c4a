"""What each adapter keeps in ``Quantized.handle``: plain records, in a module of their own
so that an adapter and its layer facet (``bitsandbytes_layer``, ``hqq_layer``) both name
them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class BnbHandle:
    """What ``quantize_4bit`` returned: the packed uint8 tensor and its ``QuantState``."""

    packed: torch.Tensor
    state: Any  # bitsandbytes.functional.QuantState


@dataclass(frozen=True)
class HqqHandle:
    """The quantized ``HQQLinear`` (its ``compute_dtype`` is the weight's dtype)."""

    layer: Any  # hqq.core.quantize.HQQLinear


@dataclass(frozen=True)
class GemliteHandle:
    """An HQQ layer converted by gemlite (``GemLiteLinearTriton``), and the HQQ state it was
    converted from (a checkpoint's, to convert again at another compute dtype)."""

    layer: Any  # gemlite.core.GemLiteLinearTriton
    hqq_state: dict[str, torch.Tensor]
    dtype: torch.dtype

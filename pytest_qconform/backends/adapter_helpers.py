"""What an adapter needs besides the contract (public API: ``docs/downstream.md``, section 4).

An import failure as a one-line reason (``availability()`` must never raise), dtype names as
reports spell them, and host copies of a tensor's values or packed bytes for
``export_packed``.
"""

from __future__ import annotations

import numpy as np
import torch


def import_failure(library: str, exc: BaseException) -> str:
    """``"<library>: import failed: <ExcType>: <first line of the message>"``."""
    lines = str(exc).strip().splitlines()
    return f"{library}: import failed: {type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError naming an unknown one."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {str(name)!r}")
    return dtype


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Host copy of a tensor's values as stored; bfloat16 (which NumPy lacks) is widened to
    float32, which is exact."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy()


def packed_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a packed tensor as flat uint8, whatever dtype stores them (bitsandbytes'
    ``quant_storage``): a bit-exact view, never a value conversion."""
    return to_numpy(tensor.detach().reshape(-1).view(torch.uint8))

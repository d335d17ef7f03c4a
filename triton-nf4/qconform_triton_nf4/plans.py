"""The Triton adapter's eager calls, planned once per weight and activation layout.

Why: a model's forward calls the matmul with the same weight and the same activation
layout over and over, without a CUDA graph. Validating the state, choosing a kernel,
computing its tiles and binding Triton's launch on every call cost far more host time
than the gemv takes on the device (bench/notes.md, "Host cost per call"). So the first
call of a (weight, layout) goes through the kernels' public entry points, which validate
everything (and are what ``kernel_calls.Recorder`` logs), and leaves a plan in the
weight's ``Nf4State.plans``; later calls with the same key run the plan: one allocation
for the output and the bound launches (``kernels.launch.BoundLaunch``), no validation,
no device sync and no read of device data.

The key holds every property of the activation that a kernel choice or Triton's
specialization reads: dtype, shape, strides, the data pointer modulo 16, device, and the
same of the bias. Anything else (a new dtype, an odd view) gets its own plan; the state
is immutable (a frozen dataclass whose tensors the adapter never writes), so its plans
never go stale, and ``Nf4State.__deepcopy__`` gives a copy empty plans (a copied plan
would read the original's tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import torch

_ALIGNMENT = 16  # Triton specializes a pointer on whether it is a multiple of 16

Plan = Callable[..., torch.Tensor]


def tensor_key(t: torch.Tensor | None) -> Hashable:
    """What a plan depends on in ``t``: dtype, shape, strides, pointer alignment, device."""
    if t is None:
        return None
    return (t.dtype, t.shape, t.stride(), t.data_ptr() % _ALIGNMENT, t.device)


def linear_plan(
    x: torch.Tensor,
    state: Any,
    bias: torch.Tensor | None,
    fused_max_rows: int,
    buffered: Callable[[torch.dtype], torch.Tensor],
) -> Plan | None:
    """``plan(x, bias) -> x W^T + b`` for activations keyed like ``x`` and ``bias`` (the
    route ``triton_nf4_ops.fused_or_dequantized`` takes, decided once), or None where the
    entry points' own handling of empty operands is the right path."""
    from qconform_triton_nf4 import kernels

    N, K = state.shape
    rows = math.prod(x.shape[:-1])
    if rows == 0 or N == 0 or K == 0:
        return None
    lead = tuple(x.shape[:-1])
    if rows <= min(fused_max_rows, kernels.fused_rows_limit(x, state.packed, K)):
        x2 = x.reshape(-1, K)
        gemv = kernels.nf4_gemv.plan_gemv(x2, state.packed, state.absmax, bias is not None, state.kernel_args())

        def fused(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            out = torch.empty((rows, N), dtype=x.dtype, device=x.device)
            gemv(x.reshape(-1, K), out, bias.reshape(-1).contiguous() if bias is not None else None)
            return out.view(*lead, N)

        return fused

    def dequantized(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.matmul(x, buffered(x.dtype).t())
        return y + bias if bias is not None else y

    return dequantized


def dequantize_plan(state: Any, dtype: torch.dtype) -> Callable[[torch.Tensor], None] | None:
    """``plan(out)``: the state decoded into ``out`` (contiguous, the state's shape, ``dtype``),
    or None for an empty weight."""
    from qconform_triton_nf4 import kernels

    if math.prod(state.shape) == 0:
        return None
    return kernels.nf4_dequant.plan_dequantize(state.packed, state.absmax, dtype, state.kernel_args())

"""The Triton adapter's matmul route, planned once per weight and activation layout.

Why: a model's forward calls the matmul with the same weight and the same activation
layout over and over, without a CUDA graph. Validating the state, choosing a kernel,
computing its tiles and binding Triton's launch on every call cost far more host time
than the gemv takes on the device (bench/notes.md, "Host cost per call"). So the route
is a plan: ``linear_plan`` validates the call through the kernels' checks
(``kernels.gemv_4bit_plan``, ``kernels.dequantize_4bit_plan``: what ``gemv_4bit`` and
``dequantize_4bit`` run on every call, and what ``kernel_calls.Recorder`` logs), decides
the route and binds the launches, and the plan runs the call: one allocation for the
output and the bound launches (``kernels.launch.BoundLaunch``), no validation, no device
sync and no read of device data. The adapter keeps a plan per key in the weight's
``Nf4State.plans`` and builds it on the first call of that key; the custom operator that
``torch.compile`` calls (``triton_nf4.ops``) builds one per call. There is no other route.

The key (``plan_key``) holds every property of the activation that a kernel choice or
Triton's specialization reads: dtype, shape, strides, the data pointer modulo 16, the
device, and the same of the bias. Anything else (a new dtype, an odd view) gets its own
plan; the state is immutable (a frozen dataclass whose tensors the adapter never writes),
so its plans never go stale, and ``Nf4State.__deepcopy__`` gives a copy empty plans (a
copied plan would read the original's tensors).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch

_ALIGNMENT = 16  # Triton specializes a pointer on whether it is a multiple of 16

Plan = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def plan_key(x: torch.Tensor, bias: torch.Tensor | None) -> Hashable:
    """What a matmul plan depends on in ``x`` and ``bias``: dtype, shape, strides, pointer
    alignment and device index of each (one flat tuple: it is built on every call)."""
    if bias is None:
        return (x.dtype, x.shape, x.stride(), x.data_ptr() % _ALIGNMENT, x.get_device())
    return (
        x.dtype,
        x.shape,
        x.stride(),
        x.data_ptr() % _ALIGNMENT,
        x.get_device(),
        bias.dtype,
        bias.shape,
        bias.stride(),
        bias.data_ptr() % _ALIGNMENT,
        bias.get_device(),
    )


def linear_plan(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    kernel_args: Mapping[str, Any],
    bias: torch.Tensor | None,
    fused_max_rows: int,
    dequantized: Callable[[torch.dtype], torch.Tensor],
    tc_max_rows: int | None = None,
    ws_max_rows: int | None = None,
) -> Plan:
    """``plan(x, bias) -> x W^T + b`` for activations and biases laid out like ``x`` and
    ``bias``. From ``kernels.ws_min_rows`` to ``ws_max_rows`` rows, the warp-specialized
    GEMM (Hopper) where it reads x and the bytes in place (``kernels.ws_gemm_4bit_plan``).
    Otherwise: as many rows as the fused ``gemv_4bit`` serves faster (at most
    ``fused_max_rows``) through its plan, validated by ``kernels.gemv_4bit_plan``; more rows,
    up to ``tc_max_rows``, through the fused tensor-core GEMM where it reads x
    (``kernels.tc_gemm_4bit_plan``); the rest multiply ``dequantized(x.dtype)`` with
    ``torch.matmul``. ``tc_max_rows`` and ``ws_max_rows``: None for the thresholds of x's
    arch class (``kernels.tc_max_rows``, ``kernels.ws_max_rows``: where
    bench/tc_gemm_sweep.py measured them faster, 0 elsewhere; the latter more rows for a
    large weight); the sweep and the tests pass their own. ``kernel_args``:
    ``Nf4State.kernel_args()``."""
    from qconform_triton_nf4 import kernels

    K = kernel_args["shape"][1]
    rows = math.prod(x.shape[:-1])
    if takes_ws_route(x, packed, kernel_args, ws_max_rows):
        return kernels.ws_gemm_4bit_plan(x, packed, absmax, bias=bias, **kernel_args)
    if rows <= min(fused_max_rows, kernels.fused_rows_limit(x, packed, K)):
        return kernels.gemv_4bit_plan(x, packed, absmax, bias=bias, **kernel_args)
    tc_rows = kernels.tc_max_rows(x.device) if tc_max_rows is None else tc_max_rows
    if rows <= tc_rows and kernels.tc_gemm_readable(x, K):
        return kernels.tc_gemm_4bit_plan(x, packed, absmax, bias=bias, **kernel_args)

    def dequantized_route(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.matmul(x, dequantized(x.dtype).t())
        return y + bias if bias is not None else y

    return dequantized_route


def takes_ws_route(
    x: torch.Tensor, packed: torch.Tensor, kernel_args: Mapping[str, Any], ws_max_rows: int | None = None
) -> bool:
    """Whether ``linear_plan`` sends x to the warp-specialized GEMM: its arch class's rows
    (``kernels.ws_min_rows`` to ``ws_max_rows``, None: ``kernels.ws_max_rows`` for this
    weight's size) and a layout it reads. The zoo's mutant of the route asks it too."""
    from qconform_triton_nf4 import kernels

    N, K = kernel_args["shape"]
    rows = math.prod(x.shape[:-1])
    low = kernels.ws_min_rows(x.device)  # 0 where the kernel does not run
    high = kernels.ws_max_rows(x.device, N * K) if ws_max_rows is None else ws_max_rows
    return bool(low) and low <= rows <= high and kernels.ws_gemm_readable(x, packed, K, kernel_args["blocksize"])


def native_launch(plan: Plan, x: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``plan`` as one native call for calls laid out as ``x`` and ``bias``
    (``kernels.native_launch``: ``launch(x, bias) -> out``, or None where x or bias is laid
    out otherwise or autograd would record the call), or None where the plan has none (the
    dequantize route, a K split, no native launch here). Made after the plan's first call,
    which binds its launches."""
    make = getattr(plan, "native", None)
    return make(x, bias) if make is not None else None

"""Our NF4 kernels as torch custom operators, the form ``torch.compile`` takes them in.

Why: dynamo traces a Python kernel launcher like any other Python. Under
``TRITON_INTERPRET=1`` that launcher is Triton's interpreter, whose NumPy pointer
arithmetic dynamo cannot run on fake tensors (``KeyError(torch.uint64)`` after ~40 s of
tracing, torch 2.13 / Triton 3.9), and the adapter's routing reads a data pointer
(``kernels.fused_rows_limit``), which fake tensors do not have. An operator with a
shape-only fake implementation is PyTorch's documented way to put a third-party kernel
into a graph (bitsandbytes registers its kernels the same way), on the CPU and the GPU
alike. The adapter calls these only while dynamo traces (``torch.compiler.is_compiling()``):
eager calls, and CUDA-graph capture, go to the kernels directly, with no dispatcher in
front of the benchmarked path (an eager call of the operator, its dispatcher and a plan
built per call, took 130-260 us of host time on the H100 host: bench/notes.md). Inductor
calls the operator from its generated code; under ``mode="reduce-overhead"`` the launches
it makes are captured in the step's CUDA graph. Inside an operator the code is the eager
route (``plans.linear_plan``), run on real tensors; only the adapter's reusable
``WeightBuffer`` is left out (a compiled graph owns its memory).

Registered once, when ``triton_nf4`` is imported (the namespace ``qconform``).
"""

# No ``from __future__ import annotations``: custom_op reads the parameter types as objects.
import torch


def _kernel_args(code, nested_absmax, nested_code, blocksize, shape, nested_blocksize, offset) -> dict:
    return {
        "blocksize": blocksize,
        "shape": tuple(shape),
        "code": code,
        "nested_absmax": nested_absmax,
        "nested_code": nested_code,
        "nested_blocksize": nested_blocksize,
        "offset": offset,
    }


@torch.library.custom_op("qconform::nf4_dequantize", mutates_args=())
def nf4_dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    blocksize: int,
    shape: list[int],
    nested_blocksize: int,
    offset: float | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``kernels.dequantize_4bit`` into a fresh tensor."""
    from qconform_triton_nf4 import kernels

    kernel_args = _kernel_args(code, nested_absmax, nested_code, blocksize, shape, nested_blocksize, offset)
    return kernels.dequantize_4bit(packed, absmax, out_dtype=out_dtype, **kernel_args)


@nf4_dequantize.register_fake
def _(packed, absmax, code, nested_absmax, nested_code, blocksize, shape, nested_blocksize, offset, out_dtype):
    return packed.new_empty(tuple(shape), dtype=out_dtype)


@torch.library.custom_op("qconform::nf4_linear", mutates_args=())
def nf4_linear(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    blocksize: int,
    shape: list[int],
    nested_blocksize: int,
    offset: float | None,
    fused_max_rows: int,
) -> torch.Tensor:
    """The adapter's route (``plans.linear_plan``, built for this call), the weight
    dequantized afresh."""
    from qconform_triton_nf4 import kernels
    from qconform_triton_nf4.plans import linear_plan

    kernel_args = _kernel_args(code, nested_absmax, nested_code, blocksize, shape, nested_blocksize, offset)
    plan = linear_plan(
        x,
        packed,
        absmax,
        kernel_args,
        bias,
        fused_max_rows,
        lambda dtype: kernels.dequantize_4bit(packed, absmax, out_dtype=dtype, **kernel_args),
    )
    return plan(x, bias)


@nf4_linear.register_fake
def _(
    x,
    bias,
    packed,
    absmax,
    code,
    nested_absmax,
    nested_code,
    blocksize,
    shape,
    nested_blocksize,
    offset,
    fused_max_rows,
):
    return x.new_empty((*x.shape[:-1], shape[0]))


def state_args(state) -> tuple:
    """The operators' arguments for ``state`` (a ``triton_nf4.Nf4State``), after x and bias."""
    return (
        state.packed,
        state.absmax,
        state.code,
        state.nested_absmax,
        state.nested_code,
        state.blocksize,
        list(state.shape),
        state.nested_blocksize,
        state.offset,
    )


def dequantize(state, dtype: torch.dtype) -> torch.Tensor:
    """``state`` (``triton_nf4.Nf4State``) decoded to ``dtype`` through the operator."""
    return nf4_dequantize(*state_args(state), dtype)


def linear(x: torch.Tensor, state, bias: torch.Tensor | None, fused_max_rows: int) -> torch.Tensor:
    """``x W^T + b`` for ``state`` (``triton_nf4.Nf4State``) through the operator."""
    return nf4_linear(x, bias, *state_args(state), fused_max_rows)

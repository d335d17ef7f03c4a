"""Checks of tensors too large to decode in one piece: the reference compares them a
slice of whole (nested) blocks at a time. Used by ``test_real_shapes``; the 2^31-element
check runs from here in a child process (``_isolated``), so it must be importable."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from pytest_qconform.reference import bnb4, bounds, linear
from pytest_qconform.reference.packed import PackedBnb4

from pytest_qconform.backends.base import Backend, QuantSpec
from pytest_qconform.session.outcomes import skip_not_claimed

from ._cases import packed_dequantize_bound, reference_decode

CHUNK_ELEMENTS = 1 << 26  # elements the reference decodes at once: bounded memory


def slice_blocks(p: PackedBnb4, first_element: int, elements: int) -> PackedBnb4:
    """Elements ``[first_element, first_element + elements)`` of a bitsandbytes-layout
    state as a state of their own (1-D), so the reference decodes a slice at a time.
    ``first_element`` must start a nested group (or a block, without nesting)."""
    group = p.blocksize * (p.nested_blocksize or 1)
    if first_element % group or first_element % 2:
        raise ValueError(f"slice_blocks: {first_element} does not start a group of {group} elements")
    elements = min(elements, p.numel - first_element)
    first_block, blocks = first_element // p.blocksize, math.ceil(elements / p.blocksize)
    packed = np.asarray(p.packed).reshape(-1)[first_element // 2 : (first_element + elements + 1) // 2]
    absmax = np.asarray(p.absmax).reshape(-1)[first_block : first_block + blocks]
    nested = None
    if p.double_quant:
        first_group = first_block // p.nested_blocksize
        nested = np.asarray(p.nested_absmax).reshape(-1)[
            first_group : first_group + math.ceil(blocks / p.nested_blocksize)
        ]
    return dataclasses.replace(p, shape=(elements,), packed=packed, absmax=absmax, nested_absmax=nested)


def check_in_chunks(qcheck, out: torch.Tensor, packed, dtype: torch.dtype, what: str) -> None:
    """``out`` (the backend's dequantization) against the reference, a slice at a time."""
    if not isinstance(packed, PackedBnb4) or packed.numel <= CHUNK_ELEMENTS:
        exact = reference_decode(packed, out.device)
        qcheck.within(out, exact, packed_dequantize_bound(packed, exact, dtype), what)
        return
    group = packed.blocksize * (packed.nested_blocksize or 1)
    step = max(group, CHUNK_ELEMENTS // group * group)
    flat = out.reshape(-1)
    for start in range(0, packed.numel, step):
        part = slice_blocks(packed, start, step)
        exact = bnb4.decode(part, device=out.device)
        qcheck.within(
            flat[start : start + part.numel],
            exact,
            bounds.bnb4_dequantize_bound(part, dtype, out.device),
            f"{what}, elements {start}..{start + part.numel - 1}",
        )


def random_state(spec: QuantSpec, shape: tuple[int, int], seed: int) -> PackedBnb4:
    """Random codes and scales in bitsandbytes' layout (no float weight of 8 GiB to
    quantize): every byte pattern and block is as likely as any other."""
    rng = np.random.default_rng(seed)
    numel = math.prod(shape)
    blocks = math.ceil(numel / spec.blocksize)
    state = PackedBnb4(
        quant_type=spec.format,
        blocksize=spec.blocksize,
        shape=shape,
        packed=rng.integers(0, 256, (numel + 1) // 2, dtype=np.uint8),
        absmax=rng.uniform(0.5, 2.0, blocks).astype(np.float32),
        code=np.asarray(bnb4.code_table(spec.format), dtype=np.float32),
        dtype="bfloat16",
    )
    if not spec.double_quant:
        return state
    from pytest_qconform.reference.formats import dynamic_map_signed

    return dataclasses.replace(
        state,
        absmax=rng.integers(0, 256, blocks, dtype=np.uint8),
        nested_absmax=rng.uniform(0.5, 1.0, math.ceil(blocks / 256)).astype(np.float32),
        nested_code=np.asarray(dynamic_map_signed(), dtype=np.float32),
        nested_blocksize=256,
        offset=1.25,
    )


def check_large_tensor(backend: Backend, qcheck, spec: QuantSpec, shape: tuple[int, int], device: str) -> None:
    """Dequantize and batch-1 matmul of random bytes of ``shape`` adopted through
    ``from_packed``, against the reference a slice of whole nested groups at a time."""
    device = torch.device(device)
    packed = random_state(spec, shape, seed=31)
    qcheck.describe(shape=shape, seed=31, source="random bytes")
    try:
        quantized = backend.from_packed(packed, device)
    except NotImplementedError as exc:
        skip_not_claimed(str(exc))
    out = backend.dequantize(quantized, torch.bfloat16)
    check_in_chunks(qcheck, out, packed, torch.bfloat16, "dequantize of 2^31+ elements")
    del out
    n, k = shape
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    y = backend.matmul(x, quantized, None, torch.bfloat16).reshape(-1)
    rows = max(1, CHUNK_ELEMENTS // k)
    for first in range(0, n, rows):
        part = slice_blocks(packed, first * k, min(rows, n - first) * k)
        part = dataclasses.replace(part, shape=(part.numel // k, k))
        w = bnb4.decode(part, device=device)
        bound = bounds.matmul_bound(
            x.double(),
            w,
            None,
            torch.bfloat16,
            torch.bfloat16,
            w_error=bounds.bnb4_matmul_weight_bound(part, torch.bfloat16, device=device),
        )
        qcheck.within(
            y[first : first + w.shape[0]],
            linear.linear(x.double(), w).reshape(-1),
            bound.reshape(-1),
            f"batch-1 matmul rows {first}..{first + w.shape[0] - 1} of 2^31+ elements",
        )

"""Checks of tensors too large to decode in one piece: the reference compares them a
slice of whole (nested) blocks, or of whole HQQ groups, at a time. Used by
``test_real_shapes``; the 2^31-element check runs from here in a child process
(``_isolated``), so it must be importable."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from pytest_qconform.reference import bnb4, bounds, hqq4, linear
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

from pytest_qconform.backends.base import Backend, Capabilities, QuantSpec
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


def slice_groups(p: PackedHqq4, first_element: int, elements: int) -> PackedHqq4:
    """Elements ``[first_element, first_element + elements)`` of an HQQ state grouped along
    its rows (axis 1: one group of ``group_size`` consecutive elements per row of Q) as a
    state of their own (1-D), packed as HQQ packs it (``hqq4``: the high nibbles of byte row
    ``r`` hold Q's row ``r``, the low nibbles its row ``r + R/2``), so the reference decodes
    a slice at a time. The slice must hold an even number of whole groups."""
    if p.axis != 1:
        raise ValueError(f"slice_groups: HQQ axis {p.axis} groups run across rows; only axis 1 is sliced")
    rows, cols = hqq4.grouped_shape(tuple(p.shape), p.group_size, p.axis)
    elements = min(elements, rows * cols - first_element)
    if first_element % p.group_size or elements % (2 * p.group_size):
        raise ValueError(
            f"slice_groups: elements {first_element}..{first_element + elements - 1} are not an even number of "
            f"whole groups of {p.group_size}"
        )
    first, count, half = first_element // p.group_size, elements // p.group_size, rows // 2
    data = np.asarray(p.packed).reshape(half, cols)
    high = data[first : min(first + count, half)] >> 4  # Q's rows below R/2
    low = data[max(first, half) - half : max(first + count, half) - half] & 0x0F  # Q's rows from R/2 on
    q = np.concatenate([high, low]).astype(np.uint8)
    packed = (q[: count // 2] << 4) | q[count // 2 :]
    scale = np.asarray(p.scale).reshape(-1)[first : first + count].reshape(count, 1)
    zero = np.asarray(p.zero).reshape(-1)[first : first + count].reshape(count, 1)
    return dataclasses.replace(p, shape=(elements,), packed=packed, scale=scale, zero=zero)


def _slice(p: PackedBnb4 | PackedHqq4, first_element: int, elements: int) -> PackedBnb4 | PackedHqq4:
    return (
        slice_blocks(p, first_element, elements)
        if isinstance(p, PackedBnb4)
        else slice_groups(p, first_element, elements)
    )


def _slice_unit(p: PackedBnb4 | PackedHqq4) -> int:
    """The elements a slice starts and ends on: a nested group of blocks, or two HQQ groups."""
    return p.blocksize * (p.nested_blocksize or 1) if isinstance(p, PackedBnb4) else 2 * p.group_size


def check_in_chunks(qcheck, out: torch.Tensor, packed, dtype: torch.dtype, what: str) -> None:
    """``out`` (the backend's dequantization) against the reference, a slice at a time."""
    numel = math.prod(packed.shape)
    if not isinstance(packed, (PackedBnb4, PackedHqq4)) or numel <= CHUNK_ELEMENTS:
        exact = reference_decode(packed, out.device)
        qcheck.within(out, exact, packed_dequantize_bound(packed, exact, dtype), what)
        return
    unit = _slice_unit(packed)
    step = max(unit, CHUNK_ELEMENTS // unit * unit)
    flat = out.reshape(-1)
    for start in range(0, numel, step):
        part = _slice(packed, start, step)
        exact = reference_decode(part, out.device)
        qcheck.within(
            flat[start : start + exact.numel()],
            exact,
            packed_dequantize_bound(part, exact, dtype),
            f"{what}, elements {start}..{start + exact.numel() - 1}",
        )


def random_state(spec: QuantSpec, shape: tuple[int, int], seed: int) -> PackedBnb4 | PackedHqq4:
    """Random codes and scales in the spec's layout, bitsandbytes' or HQQ's (no float weight
    of 8 GiB to quantize): every byte pattern and block is as likely as any other."""
    rng = np.random.default_rng(seed)
    numel = math.prod(shape)
    if spec.format == "hqq4":
        return _random_hqq_state(spec, shape, rng)
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


def _bf16_values(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (held in float32: NumPy has no bf16), as HQQ's
    bf16 layer stores its scale and zero."""
    return torch.from_numpy(values.astype(np.float32)).to(torch.bfloat16).float().numpy()


def _random_hqq_state(spec: QuantSpec, shape: tuple[int, int], rng: np.random.Generator) -> PackedHqq4:
    """Random 4-bit values in HQQ's ``4bit_u8`` packing, with a scale and a zero point per
    group as a bf16 layer holds them (zero points around the codes' middle, as HQQ's are)."""
    rows, cols = hqq4.grouped_shape(shape, spec.blocksize, spec.axis)
    groups = rows if spec.axis == 1 else cols
    per_group = (groups, 1) if spec.axis == 1 else (1, groups)
    return PackedHqq4(
        shape=shape,
        group_size=spec.blocksize,
        axis=spec.axis,
        packed=rng.integers(0, 256, (rows // 2, cols), dtype=np.uint8),
        scale=_bf16_values(rng.uniform(0.005, 0.02, per_group)),
        zero=_bf16_values(rng.uniform(6.0, 9.0, per_group)),
        meta={"compute_dtype": "bfloat16", "scale_dtype": "bfloat16", "zero_dtype": "bfloat16", "nbits": 4},
    )


def route_rows(caps: Capabilities) -> tuple[int, ...]:
    """One activation per route the backend declares: one row, the first row count of each
    route (``dispatch_rows``, ``max_gemv_rows + 1``), the fused path's last
    (``max_gemv_rows``), and a prefill of 300 rows."""
    rows = {1, 300, *caps.dispatch_rows}
    if caps.max_gemv_rows:
        rows.update((caps.max_gemv_rows, caps.max_gemv_rows + 1))
    return tuple(sorted(rows))


def _weight_rows(packed: PackedBnb4 | PackedHqq4, first: int, count: int) -> PackedBnb4 | PackedHqq4:
    """Weight rows ``[first, first + count)`` of a 2-D state as a 2-D state of their own."""
    k = packed.shape[1]
    part = _slice(packed, first * k, count * k)
    return dataclasses.replace(part, shape=(math.prod(part.shape) // k, k))


def check_large_tensor(
    backend: Backend,
    qcheck,
    spec: QuantSpec,
    shape: tuple[int, int],
    device: str,
    rows: tuple[int, ...] = (1,),
    backward: bool = False,
) -> None:
    """Random bytes of ``shape`` adopted through ``from_packed``: dequantize, a matmul at each
    of ``rows`` (one activation per route, ``route_rows``) and, with ``backward``, the
    gradient of x at 5 rows, each against the reference a slice of whole nested groups (or
    whole weight rows) at a time. Every result is computed before the first slice is
    decoded, so the weight's bytes are read by the backend as a whole."""
    device = torch.device(device)
    dtype = torch.bfloat16
    packed = random_state(spec, shape, seed=31)
    qcheck.describe(shape=shape, seed=31, source="random bytes", rows=rows)
    try:
        quantized = backend.from_packed(packed, device)
    except NotImplementedError as exc:
        skip_not_claimed(str(exc))
    out = backend.dequantize(quantized, dtype)
    check_in_chunks(qcheck, out, packed, dtype, "dequantize of 2^31+ elements")
    del out
    n, k = shape
    xs = [torch.randn(r, k, generator=torch.Generator().manual_seed(r)).to(dtype).to(device) for r in rows]
    ys = [backend.matmul(x, quantized, None, dtype) for x in xs]
    x_grad = dy = None
    if backward:
        x_grad = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(dtype).to(device)
        x_grad.requires_grad_(True)
        y = backend.matmul(x_grad, quantized, None, dtype)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
        y.backward(dy)
        del y
    step = max(1, CHUNK_ELEMENTS // k)
    dx_exact = dx_error = None
    for first in range(0, n, step):
        part = _weight_rows(packed, first, min(step, n - first))
        w = reference_decode(part, device)
        last = first + w.shape[0] - 1
        e_dequantized = packed_dequantize_bound(part, w, dtype)  # a weight dequantized, then multiplied
        bnb = isinstance(part, PackedBnb4)  # bitsandbytes' fused kernel: bounds.weight_error
        fused = [bnb and bounds.bnb_fused_kernel_may_run(x.shape[0], device) for x in xs]
        e_fused = bounds.bnb4_matmul_weight_bound(part, dtype, device=device) if any(fused) else None
        for x, y, in_fused_kernel in zip(xs, ys, fused):
            w_error = e_fused if in_fused_kernel else e_dequantized
            qcheck.within(
                y[:, first : last + 1],
                linear.linear(x.double(), w),
                bounds.matmul_bound(x.double(), w, None, dtype, dtype, w_error=w_error),
                f"matmul of 2^31+ elements at {x.shape[0]} rows, weight rows {first}..{last}",
            )
        if dy is not None:
            # dx = sum over the slices of dy_s W_s: each slice's share of the exact product and of
            # its error bound (matmul_bound over the whole reduction's length, its result unrounded:
            # float64), the rounding to the output dtype added once, of the whole sum.
            dy_s = dy[:, first : last + 1].double()
            exact = dy_s @ w
            share = bounds.matmul_bound(
                dy_s,
                w.T,
                None,
                dtype,
                torch.float64,
                k=n,
                w_error=e_dequantized.T,
                exact=exact,
            )
            dx_exact = exact if dx_exact is None else dx_exact.add_(exact)
            dx_error = share if dx_error is None else dx_error.add_(share)
        del w, e_dequantized, e_fused
    if x_grad is not None and dx_exact is not None and dx_error is not None:
        grad = x_grad.grad
        if grad is None or not torch.isfinite(grad).all():
            qcheck.equal("missing" if grad is None else "not finite", "finite", "gradient of x (2^31+ elements)")
        bound = bounds.rounding_bound(dx_exact.abs().add(dx_error), dtype).add_(dx_error)
        qcheck.within(grad, dx_exact, bound, "d x of 2^31+ elements at 5 rows, a sum over every weight row")

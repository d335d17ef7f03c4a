"""Error bounds derived from the arithmetic, and how far a result is from its bound.

Model (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 2-3): a
floating-point operation in a format with unit roundoff ``u`` returns the exact result
times ``(1 + d)``, ``|d| <= u`` (round to nearest), as long as it neither overflows nor
underflows; an underflowing result is off by at most half the subnormal spacing
``eta``. A chain of ``n`` such roundings multiplies by ``(1 + t)``, ``|t| <= gamma_n =
n u / (1 - n u)``. A dot product of ``n`` terms, products and sums rounded in any order,
is off by at most ``gamma_n * sum |x_k| |y_k|`` (Higham eq. 3.5).

Every bound here is per element, float64, on the device of its input, and is a bound on
``|actual - exact|`` where ``exact`` is the float64 reference. A result passes when
``error_multiple(actual, exact, bound) <= BOUND_MULTIPLE``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest_qconform.reference.bnb4 as bnb4
import pytest_qconform.reference.gemlite4 as gemlite4
import pytest_qconform.reference.hqq4 as hqq4
import torch
from pytest_qconform.reference.linear import linear
from pytest_qconform.reference.packed import PackedBnb4, PackedGemlite4, PackedHqq4

__all__ = [
    "BOUND_MULTIPLE",
    "FLUSHES_SUBNORMALS",
    "underflow_error",
    "layer_weight_error",
    "weight_error",
    "bnb4_dequantize_bound",
    "bnb4_matmul_weight_bound",
    "bnb_fused_kernel_may_run",
    "dequantize_bound",
    "error_multiple",
    "gamma",
    "grad_bound",
    "hqq4_dequantize_bound",
    "matmul_bound",
    "rounding_bound",
    "rounding_direction",
    "rounding_direction_biased",
    "unit_roundoff",
]

# A result passes when its worst error is at most this multiple of its derived bound.
# 1.0: the bounds are worst cases of the arithmetic, not statistical estimates, so a
# conformant backend never exceeds them; no slack for "usually" is needed or allowed.
BOUND_MULTIPLE: float = 1.0


def _finfo(dtype: torch.dtype) -> torch.finfo:
    if not dtype.is_floating_point:
        raise ValueError(f"a rounding bound needs a floating-point dtype, got {dtype}")
    return torch.finfo(dtype)


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = 2**-p`` for a format with ``p`` significand bits (implicit bit included), the
    largest relative error of round to nearest: float64 2**-53, float32 2**-24, float16
    2**-11, bfloat16 2**-8 (= ``finfo.eps / 2``)."""
    return float(_finfo(dtype).eps) / 2


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)``, the relative error of ``n`` chained roundings
    (infinite once ``n u >= 1``: nothing is bounded any more)."""
    if n <= 0:
        return 0.0
    return math.inf if n * u >= 1 else n * u / (1 - n * u)


def _half_subnormal(dtype: torch.dtype) -> float:
    """``eta``: half the spacing of the subnormals, the worst error of an underflow."""
    fi = _finfo(dtype)
    return float(fi.tiny) * float(fi.eps) / 2


# bf16 arithmetic may flush subnormals to zero: x86's AVX512-BF16 conversion and
# dot-product instructions (VCVTNEPS2BF16, VDPBF16PS) treat subnormal inputs and results
# as zero whatever the MXCSR flags say (Intel SDM vol. 2), and the bf16 GEMMs and
# conversions built on them (oneDNN under torch, bitsandbytes' CPU kernels) inherit it.
# Seen on this project's CPU runner: a bf16 value of 1e-38 comes back 0. For these dtypes
# an underflowing result may be off by the smallest normal, not half a subnormal spacing.
FLUSHES_SUBNORMALS: frozenset[torch.dtype] = frozenset({torch.bfloat16})


def underflow_error(dtype: torch.dtype) -> float:
    """The worst absolute error of one rounding whose result lies below the smallest
    normal ``tiny``: ``eta`` under IEEE gradual underflow, ``tiny`` itself for a dtype in
    ``FLUSHES_SUBNORMALS`` (a flushed result loses all of a value smaller than ``tiny``)."""
    return float(_finfo(dtype).tiny) if dtype in FLUSHES_SUBNORMALS else _half_subnormal(dtype)


def rounding_bound(exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half an ulp of ``dtype`` at ``|exact|``: the worst error of rounding ``exact`` to
    ``dtype`` (round to nearest).

    For ``2**e <= |x| < 2**(e+1)`` the spacing of ``dtype`` is ``2**(e + 1 - p)``, so half
    an ulp is ``u * 2**e``; below the smallest normal ``2**emin`` the spacing stays that of
    the subnormals, ``2 * eta`` (so 0 gets ``eta``); for a dtype in ``FLUSHES_SUBNORMALS``
    it is ``tiny`` there (flush to zero). A value at or beyond the overflow threshold
    ``max + u * 2**emax`` rounds to infinity: its bound is ``inf``. NaN gives NaN.
    """
    fi = _finfo(dtype)
    u = float(fi.eps) / 2
    emin = int(round(math.log2(float(fi.tiny))))
    emax = int(math.floor(math.log2(float(fi.max))))
    try:
        overflow = float(fi.max) + u * 2.0**emax
    except OverflowError:  # float64: the threshold is beyond float64 itself, nothing rounds to inf
        overflow = math.inf
    mag = exact.detach().to(torch.float64).abs().contiguous()
    # 2**e of the binade of |x|, read off the float64 exponent bits (mantissa cleared): exact,
    # 0 for 0 and float64 subnormals (whose binade is below every emin), inf for inf and NaN.
    binade = (mag.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)
    bound = binade.mul_(u).clamp_min_(u * 2.0**emin)  # u 2**max(e, emin), exact (powers of two)
    if dtype in FLUSHES_SUBNORMALS:
        tiny = float(fi.tiny)
        bound = torch.where(mag < tiny, tiny, bound)
    rounds = mag < overflow  # False where it overflows to inf, or is NaN
    if not bool(rounds.all()):
        bound = torch.where(rounds, bound, mag * math.inf)  # inf, and NaN for NaN
    return bound


def dequantize_bound(
    exact: torch.Tensor, out_dtype: torch.dtype, intermediate: torch.dtype = torch.float32, ops: int = 2
) -> torch.Tensor:
    """Bound for a decoded value computed by ``ops`` multiplications/subtractions of exact
    stored operands in ``intermediate`` precision, then rounded to ``out_dtype``.

    The chain gives ``v (1 + t)``, ``|t| <= gamma_ops(u_i)``, plus ``ops * eta_i`` should a
    step underflow; rounding that to ``out_dtype`` adds half an ulp at its magnitude,
    ``rounding_bound(|v| + e_i)``. When ``out_dtype`` is the intermediate dtype the last
    step's rounding is that final rounding, so the chain counts ``ops - 1`` roundings.

        bound = gamma_k(u_i) |v| + ops eta_i + rounding_bound(|v| (1 + gamma_k) + ops eta_i, out)

    Covers HQQ's ``(q - zero) * scale`` (ops=2, in the compute dtype; ``q - zero`` of two
    stored values is one rounding) and bitsandbytes' ``code * absmax`` from a plain absmax
    (ops=1, float32). For a double-quantized absmax, ``nested_code * nested_absmax +
    offset`` can cancel (a block far below the mean absmax), so a relative ``ops=3`` is
    not a guarantee: use ``bnb4_dequantize_bound``, which reads the nested state.
    """
    if ops < 0:
        raise ValueError(f"dequantize_bound: ops must be >= 0, got {ops}")
    mag = exact.detach().to(torch.float64).abs()
    chained = ops - 1 if (out_dtype == intermediate and ops > 0) else ops
    g = gamma(chained, unit_roundoff(intermediate))
    chain = g * mag + ops * _half_subnormal(intermediate)
    return chain + rounding_bound(mag + chain, out_dtype)


def bnb4_dequantize_bound(
    p: PackedBnb4, out_dtype: torch.dtype, device: str | torch.device | None = "cpu"
) -> torch.Tensor:
    """Per-element bound for bitsandbytes' dequantization of ``p`` to ``out_dtype``,
    shape ``p.shape``, from the stored state (float32 arithmetic, ``u = 2**-24``).

    Absmax. Plain: stored float32, exact. Double quantized, ``t = fl(c s)``,
    ``a^ = fl(t + offset)`` with ``c = nested_code[..]``, ``s = nested_absmax[..]``:

        |a^ - a| <= u |c s| + u |t + offset| <= u |a| + u (1 + u) |c s| + 2 eta =: E_b

    (``|c s|`` may far exceed ``|a|`` when the block's absmax is well below the mean
    ``offset``: a relative bound on ``a`` alone would not hold.)

    Element: ``w^ = fl(v a^)`` with ``v = table[code]``:
    ``|w^ - v a| <= |v| E_b + rounding_bound(|v| (|a| + E_b), float32)``; then, unless
    ``out_dtype`` is float32 (or wider), rounding to ``out_dtype`` adds
    ``rounding_bound(|v a| + e32, out_dtype)``.
    """
    dev = torch.device("cpu" if device is None else device)
    return bnb4.per_block_and_code(p, _bnb4_dequantize_table(p, out_dtype, dev))


def _bnb4_absmax_and_error(p: PackedBnb4, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|a|, E_b)`` per block, each ``[nblocks, 1]`` (``bnb4_dequantize_bound``)."""
    u = unit_roundoff(torch.float32)
    eta = _half_subnormal(torch.float32)
    absmax = bnb4.decode_absmax(p, dev)
    if p.double_quant:
        nested_code = torch.as_tensor(np.asarray(p.nested_code, dtype=np.float64).reshape(-1), device=dev)
        codes = torch.as_tensor(np.asarray(p.absmax).reshape(-1).astype(np.int64), device=dev)
        nested = torch.as_tensor(np.asarray(p.nested_absmax, dtype=np.float64).reshape(-1), device=dev)
        cs = (nested_code[codes] * nested.repeat_interleave(int(p.nested_blocksize))[: absmax.numel()]).abs()
        absmax_error = u * absmax.abs() + u * (1 + u) * cs + 2 * eta
    else:
        absmax_error = torch.zeros_like(absmax)
    return absmax.abs().unsqueeze(1), absmax_error.unsqueeze(1)


def _bnb4_dequantize_table(p: PackedBnb4, out_dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """``bnb4_dequantize_bound`` for every block and code, ``[nblocks, 16]``: the bound of an
    element depends on nothing else (``bnb4.per_block_and_code`` reads it out)."""
    u = unit_roundoff(torch.float32)
    values = torch.tensor(bnb4.code_table(p.quant_type), dtype=torch.float64, device=dev).abs()
    a, e_a = _bnb4_absmax_and_error(p, dev)
    e32 = values * e_a + rounding_bound(values * (a + e_a), torch.float32)
    if unit_roundoff(out_dtype) < u or out_dtype == torch.float32:
        return e32
    return e32 + rounding_bound(values * a + e32, out_dtype)


def bnb4_matmul_weight_bound(
    p: PackedBnb4, compute_dtype: torch.dtype, device: str | torch.device | None = "cpu"
) -> torch.Tensor:
    """``E`` of ``matmul_bound`` for a bitsandbytes-format weight used by a kernel that
    computes in ``compute_dtype``: how far the weight it multiplies by may be from the
    exact decoding.

    A dequantize-then-GEMM path rounds the fp32 ``code * absmax`` once to the compute
    dtype. bitsandbytes' CUDA gemv (``kgemm_4bit_inference_naive`` in csrc/kernels.cu)
    instead keeps the code table and the absmax in the compute dtype ``T`` and multiplies
    there: ``w = fl_T(fl_T(code) * fl_T(absmax))``, three roundings in ``u_T``, after the
    absmax itself was decoded in fp32 (double quantization). Both are conformant; the
    bound is the wider one. With ``e32 = bnb4_dequantize_bound(p, float32)`` (the fp32
    decoding's error, nested absmax included):

        E = e32 + gamma_3(u_T) (|W| + e32) + 3 eta_T

    For an fp32 compute dtype ``E = e32``.
    """
    dev = torch.device("cpu" if device is None else device)
    e32 = _bnb4_dequantize_table(p, torch.float32, dev)
    if not (compute_dtype == torch.float32 or unit_roundoff(compute_dtype) <= unit_roundoff(torch.float32)):
        table = torch.tensor(bnb4.code_table(p.quant_type), dtype=torch.float64, device=dev)
        mag = (bnb4.decode_absmax(p, dev).unsqueeze(1) * table).abs()  # |W| per block and code
        e32 = e32 + gamma(3, unit_roundoff(compute_dtype)) * (mag + e32) + 3 * underflow_error(compute_dtype)
    return bnb4.per_block_and_code(p, e32)


def _stored_dtype(name: object) -> torch.dtype:
    """A dtype named in a packed state's meta ("bfloat16", "torch.float16", ...)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in packed meta")
    return dtype


def hqq4_dequantize_bound(
    p: PackedHqq4,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
) -> torch.Tensor:
    """Bound for HQQ's ``W = (q - zero) * scale`` evaluated in ``compute_dtype`` (default:
    the layer's, ``p.meta['compute_dtype']``) and returned in ``out_dtype``.

    HQQ keeps ``zero`` and ``scale`` in the layer's compute dtype; a layer used at another
    compute dtype (a checkpoint quantized with fp32 meta loaded for bf16 compute) first
    rounds them: ``z' = z + e_z``, ``s' = s + e_s`` with ``|e_z| <= rounding_bound(z)``
    and likewise for ``s``, both zero when the stored dtype is no wider than the compute
    dtype. ``q`` (0..15) is exact. Then ``t = fl(q - z')`` and ``w = fl(t s')``, two
    roundings in ``u`` (plus ``eta`` each on underflow):

        |w - W| <= |s| e_z + |q - z| e_s + e_z e_s
                   + gamma_2(u) (|q - z| + e_z)(|s| + e_s) + 2 eta

    ``e_z`` is not relative to ``|q - z|``: a zero point near 7.5 rounded to bf16 moves
    every weight of its group by up to ``2**-6 |s|``, however small ``q - z`` is, which
    is why a single-rounding model undercounts HQQ at bf16. Rounding to a different
    ``out_dtype`` adds ``rounding_bound(|W| + e, out_dtype)``; when it is the compute
    dtype the second rounding above is that one.
    """
    compute = _stored_dtype(p.meta.get("compute_dtype", "float32")) if compute_dtype is None else compute_dtype
    # Every term is elementwise in (q, zero, scale): computed per group and 4-bit value, read out per element.
    q, zero, scale = hqq4.group_parts(p, device)
    e_z, e_s = (
        _stored_field_error(p.meta, zero, "zero_dtype", compute),
        _stored_field_error(p.meta, scale, "scale_dtype", compute),
    )
    diff = (q - zero).abs()
    s_abs = scale.abs()
    e = _affine_error(diff, s_abs, e_z, e_s, compute)
    if out_dtype != compute:
        e = e + rounding_bound(diff * s_abs + e, out_dtype)
    return hqq4.per_group_and_value(p, e)


def _stored_field_error(meta: dict, values: torch.Tensor, key: str, compute: torch.dtype) -> torch.Tensor:
    """Rounding a stored field (``meta[key]`` names its dtype) to ``compute`` before use:
    zero when the stored dtype is no wider than ``compute``."""
    if unit_roundoff(_stored_dtype(meta.get(key, "float32"))) >= unit_roundoff(compute):
        return torch.zeros_like(values)
    return rounding_bound(values, compute)


def _affine_error(
    diff: torch.Tensor, s_abs: torch.Tensor, e_z: torch.Tensor, e_s: torch.Tensor, compute: torch.dtype
) -> torch.Tensor:
    """``fl(fl(q - z) s)`` against ``(q - z) s`` with z and s off by ``e_z``, ``e_s``:
    |s| e_z + |q - z| e_s + e_z e_s + gamma_2(u) (|q - z| + e_z)(|s| + e_s) + 2 eta."""
    u = unit_roundoff(compute)
    return (
        s_abs * e_z + diff * e_s + e_z * e_s + gamma(2, u) * (diff + e_z) * (s_abs + e_s) + 2 * underflow_error(compute)
    )


def gemlite4_dequantize_bound(
    p: PackedGemlite4,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype | None = None,
    device: str | torch.device | None = "cpu",
) -> torch.Tensor:
    """Bound for gemlite's dequantization of a converted HQQ layer (``gemlite4``), evaluated
    in ``compute_dtype`` (default: the layer's, ``p.meta['compute_dtype']``) and returned in
    ``out_dtype``. Stored fields wider than the compute dtype are first rounded to it
    (``e_z``, ``e_s`` as in ``hqq4_dequantize_bound``; zero otherwise). Then

        mode 3, ``fl(fl(q - z) s)``:  as HQQ, |w - W| <= |s| e_z + |q - z| e_s + e_z e_s
                                       + gamma_2(u) (|q - z| + e_z)(|s| + e_s) + 2 eta
        mode 4, ``fma(q, s, z)``:     one rounding of the exact ``q s' + z'``:
                                       |w - W| <= |q| e_s + e_z + u (|q s| + |z| + |q| e_s + e_z) + eta
    """
    compute = _stored_dtype(p.meta.get("compute_dtype", "float32")) if compute_dtype is None else compute_dtype
    q, zero, scale = gemlite4.decode_parts(p, device)
    u = unit_roundoff(compute)
    e_z, e_s = (
        _stored_field_error(p.meta, zero, "zero_dtype", compute),
        _stored_field_error(p.meta, scale, "scale_dtype", compute),
    )
    s_abs = scale.abs()
    if p.group_mode == 3:
        diff = (q - zero).abs()
        magnitude = diff * s_abs
        e = _affine_error(diff, s_abs, e_z, e_s, compute)
    else:
        magnitude = q * s_abs + zero.abs()
        e = q * e_s + e_z + u * (magnitude + q * e_s + e_z) + underflow_error(compute)
    if out_dtype == compute:
        return e
    return e + rounding_bound(magnitude + e, out_dtype)


def _accumulate_default(compute_dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit compute dtypes (what torch's CPU and cuBLAS bf16/fp16 GEMMs and
    the 4-bit kernels accumulate in), else the compute dtype itself."""
    return torch.float32 if unit_roundoff(compute_dtype) > unit_roundoff(torch.float32) else compute_dtype


def matmul_bound(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    k: int | None = None,
    *,
    accumulate_dtype: torch.dtype | None = None,
    w_error: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound for ``y = x W^T + b`` computed in ``compute_dtype`` and returned in
    ``out_dtype``; x ``(..., K)``, W ``(N, K)`` and b ``(N,)`` exact float64, shape ``(..., N)``.

    The kernel sees its inputs rounded to the compute dtype (unit roundoff ``u``):
    ``x^ = x (1 + d)``, ``b^ = b (1 + d')`` and a weight ``W^`` with ``|W^ - W| <= E``
    (default ``E = u |W|``, the exact decoding rounded once; pass ``w_error`` for a
    weight computed less accurately, e.g. ``bnb4_dequantize_bound(p, compute_dtype)``).
    It sums the ``n = K`` products (plus the bias, ``beta = 1``) in any order in the
    accumulation dtype (unit roundoff ``u_a``), which adds at most ``gamma_{n + beta}(u_a)``
    of the magnitudes (Higham eq. 3.5). With ``M = |x| (|W| + E)^T + |b|``:

        e_c = |x| E^T + (u + (1 + u) gamma_{n + beta}(u_a)) M

    Accumulating in the compute dtype itself (``accumulate_dtype=compute_dtype``), this
    is at most ``gamma_{n + beta + 2}(u) (|x| |W|^T + |b|)`` for the default ``E``: the
    textbook ``gamma_K`` plus the two input roundings of each product. The default
    accumulation dtype is float32 for bf16/fp16: ``gamma_K(2**-8)`` is infinite from
    K = 256 on (and about 1 at K = 128), a bound that can never fail; pass the compute
    dtype for a kernel that really accumulates in 16 bits.

    Underflow (inputs near a dtype's smallest normal) adds absolute terms: an input
    rounded to the compute dtype may be off by ``eta`` instead (``eta (sum_k (|W| + E)_nk
    + beta)``), and each of the ``n`` products by ``eta_a``; a sum whose result is
    subnormal is exact (Higham, sec. 2.1), so the additions add none. A compute dtype
    that may flush subnormals (``FLUSHES_SUBNORMALS``: bf16) counts ``tiny`` for both
    (bf16 dot products flush their fp32 products too).

    Rounding the result to ``out_dtype`` adds ``rounding_bound(|y| + e_c, out_dtype)``
    (counted even when the last addition already rounded to it: one ulp of slack).
    ``k`` overrides the reduction length ``n`` (e.g. split-K partial sums added
    afterwards count as more steps). Non-finite inputs make the bound non-finite: zero
    them (``nan_to_num``) to bound the finite entries around them. ``exact``: the caller's
    ``linear(x, W, b)``, when it has it (computed here otherwise).
    """
    if w.dim() != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(
            f"matmul_bound: x {tuple(x.shape)} and W {tuple(w.shape)} do not chain: need x (..., K) and W (N, K)"
        )
    dev = x.device
    u = unit_roundoff(compute_dtype)
    u_acc = unit_roundoff(_accumulate_default(compute_dtype) if accumulate_dtype is None else accumulate_dtype)
    n = int(x.shape[-1] if k is None else k)
    # Contiguous: a permuted 3-D x (a transposed activation) does not fold into one GEMM, and
    # torch multiplies it batch by batch, 5-10 times slower at 65536 rows (the rows ladder).
    x_abs = x.detach().to(device=dev, dtype=torch.float64).abs().contiguous()
    w_abs = w.detach().to(device=dev, dtype=torch.float64).abs()
    e_w = u * w_abs if w_error is None else w_error.detach().to(device=dev, dtype=torch.float64).abs()
    w_mag = w_abs + e_w
    mag = x_abs @ w_mag.T
    if b is not None:
        mag.add_(b.detach().to(device=dev, dtype=torch.float64).abs())
    relative = u + (1 + u) * gamma(n + (b is not None), u_acc)
    acc_dtype = _accumulate_default(compute_dtype) if accumulate_dtype is None else accumulate_dtype
    product_underflow = (
        float(_finfo(acc_dtype).tiny) if compute_dtype in FLUSHES_SUBNORMALS else _half_subnormal(acc_dtype)
    )
    underflow = underflow_error(compute_dtype) * (w_mag.sum(dim=1) + (b is not None)) + n * product_underflow
    # In place where a result is ours (the same roundings in the same order as the formulas above).
    e_c = (x_abs @ e_w.T).add_(mag.mul_(relative)).add_(underflow)
    y = linear(x, w, b) if exact is None else exact.detach().to(device=dev, dtype=torch.float64)
    return rounding_bound(y.abs().add_(e_c), out_dtype).add_(e_c)


def grad_bound(
    dy: torch.Tensor,
    w: torch.Tensor,
    compute_dtype: torch.dtype,
    out_dtype: torch.dtype,
    k: int | None = None,
    *,
    accumulate_dtype: torch.dtype | None = None,
    w_error: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound for ``dx = dy W`` (dy ``(..., N)``, W ``(N, K)``) computed in ``compute_dtype``
    and returned in ``out_dtype``: ``matmul_bound`` of ``dy`` against ``W^T`` (the
    reduction runs over N), same derivation and defaults."""
    if w.dim() != 2 or dy.shape[-1] != w.shape[0]:
        raise ValueError(
            f"grad_bound: dy {tuple(dy.shape)} and W {tuple(w.shape)} do not chain: need dy (..., N) and W (N, K)"
        )
    return matmul_bound(
        dy,
        w.T,
        None,
        compute_dtype,
        out_dtype,
        k,
        accumulate_dtype=accumulate_dtype,
        w_error=None if w_error is None else w_error.T,
    )


# The most rows at which bitsandbytes' gemm_4bit may run its fused kernel: 0.50.2's
# _gemm_4bit_custom_max_m on CUDA (256 under ROCm), backends/cuda/ops.py.
BNB_FUSED_KERNEL_MAX_ROWS = 1536


def bnb_fused_kernel_may_run(rows: int | None, device: torch.device) -> bool:
    """Whether bitsandbytes may multiply ``rows`` activation rows with a fused kernel that
    rounds its code table and absmax to the compute dtype (``weight_error``): its gemv for
    one row, and on a GPU its ``gemm_4bit`` kernel up to ``BNB_FUSED_KERNEL_MAX_ROWS``."""
    return rows == 1 or (rows is not None and rows <= BNB_FUSED_KERNEL_MAX_ROWS and device.type == "cuda")


def weight_error(
    packed: PackedBnb4 | PackedHqq4 | PackedGemlite4,
    exact: torch.Tensor,
    compute_dtype: torch.dtype,
    rows: int | None = None,
) -> torch.Tensor:
    """``E`` of ``matmul_bound``: how far the weight a matmul kernel multiplies by may be
    from its exact decoding. A kernel dequantizes into its compute dtype (or keeps more
    precision): for HQQ two roundings of ``(W_q - zero) * scale`` after rounding a wider
    stored zero and scale to the compute dtype (gemlite's conversion: the same, in the
    layer's dtype); for bitsandbytes' format the fp32 ``code * absmax`` rounded once,
    except where bitsandbytes' own fused kernels may run, which round the code table and
    absmax to the compute dtype and multiply there (``bnb4_matmul_weight_bound``):
    - a single activation row on any device (``rows == 1``, the gemv path);
    - up to ``BNB_FUSED_KERNEL_MAX_ROWS`` rows on a GPU, where ``gemm_4bit`` runs its fused
      ``cgemm_4bit`` kernel at up to 4 rows always and beyond by a per-arch, per-shape
      heuristic (bitsandbytes 0.50.2, backends/cuda/ops.py ``_gemm_4bit_use_custom_cuda``).
      Measured on an H200 (issue 53, 2026-11-29): nf4 W64x128 in fp16 and bf16, rows 2-32
      erred up to 1.11 x the dequantize model's bound and at most 0.55 x this one; from
      33 rows, where it dequantizes and calls torch, 0.64 x the dequantize model's.
    The default ``u |W|`` undercounts both."""
    if isinstance(packed, PackedHqq4):
        return hqq4_dequantize_bound(packed, compute_dtype, compute_dtype, device=exact.device)
    if isinstance(packed, PackedGemlite4):
        return gemlite4_dequantize_bound(packed, compute_dtype, compute_dtype, device=exact.device)
    if bnb_fused_kernel_may_run(rows, exact.device):
        return bnb4_matmul_weight_bound(packed, compute_dtype, device=exact.device)
    return bnb4_dequantize_bound(packed, compute_dtype, device=exact.device)


def layer_weight_error(
    packed: PackedBnb4 | PackedHqq4 | PackedGemlite4, exact: torch.Tensor, compute_dtype: torch.dtype
) -> torch.Tensor:
    """``E`` for a layer's forward, which picks its kernel by itself (bitsandbytes: a fused
    kernel for one row and, on a GPU, for a few hundred; dequantize then GEMM otherwise):
    the larger of both models of ``weight_error``."""
    return torch.maximum(weight_error(packed, exact, compute_dtype), weight_error(packed, exact, compute_dtype, rows=1))


def error_multiple(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> float:
    """``max |actual - expected| / bound`` over the elements, in float64 (0.0 when empty).

    Special values: where ``bound == 0`` an exact match counts 0 and anything else inf;
    equal values (infinities of the same sign, NaN against NaN) count 0; NaN in
    ``actual`` where ``expected`` is not NaN, or the reverse, counts inf; where the bound
    is inf (``expected`` overflows the output dtype) any non-NaN value counts 0.
    """
    exp = expected.detach().to(torch.float64)
    act = actual.detach().to(device=exp.device, dtype=torch.float64)
    bnd = bound.detach().to(device=exp.device, dtype=torch.float64)
    act, exp, bnd = torch.broadcast_tensors(act, exp, bnd)
    if act.numel() == 0:
        return 0.0
    with torch.no_grad():
        ratio = (act - exp).abs_() / bnd
    worst = float(ratio.max().item())
    # Without a NaN among the ratios every special case above already holds: a zero bound gives
    # inf for a non-zero error, an infinite bound 0 for a finite one, an exact match 0.
    if not math.isnan(worst):
        return worst
    same = (act == exp) | (torch.isnan(act) & torch.isnan(exp))
    nan_mismatch = torch.isnan(act) != torch.isnan(exp)
    ratio = torch.where(bnd == 0, torch.full_like(ratio, math.inf), ratio)
    ratio = torch.where(torch.isinf(bnd) & ~torch.isnan(act), torch.zeros_like(ratio), ratio)
    ratio = torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)
    ratio = torch.where(same, torch.zeros_like(ratio), ratio)
    ratio = torch.where(nan_mismatch, torch.full_like(ratio, math.inf), ratio)
    return float(ratio.max().item())


# Round to nearest errs in either direction; rounding toward zero (a truncating bf16
# multiply or dot instruction: triton-lang/triton#11217 on RDNA) or away from it errs
# always one way, which a loose worst-case bound can hide. Judged on the elements whose
# error is non-zero and whose exact value is a normal number of the result's dtype (a
# flushed subnormal errs toward zero by design: FLUSHES_SUBNORMALS), by votes of
# independent units: errors of one unit share causes (a block's decoded absmax scales
# the whole block; a weight row's rounding reaches every output of that row), so each
# unit casts one vote, the direction most of its elements err in. With at least ROUNDING_DIRECTION_MIN_UNITS votes, no more than
# ROUNDING_DIRECTION_LIMIT may point one way: for 64 independent round-to-nearest units
# 0.8 is 4.8 standard deviations from 0.5 (binomial), while a truncating unit puts 0.9
# to 1.0 toward zero.
ROUNDING_DIRECTION_MIN_UNITS: int = 64
ROUNDING_DIRECTION_LIMIT: float = 0.8


def rounding_direction(actual: torch.Tensor, expected: torch.Tensor, units: torch.Tensor) -> tuple[float, float, int]:
    """``(toward_zero, away_from_zero, n)``: the fractions of the ``n`` voting units whose
    errors point toward zero and away from it. ``units`` (integers, broadcast to the
    result's shape) says which unit each element belongs to: its block or group for a
    dequantized weight, its output column (one weight row) for a matmul."""
    exp = expected.detach().to(torch.float64)
    act = actual.detach().to(device=exp.device, dtype=torch.float64)
    act, exp = torch.broadcast_tensors(act, exp)
    tiny = float(torch.finfo(actual.dtype).tiny) if actual.dtype.is_floating_point else 0.0
    err = act - exp
    judged = torch.isfinite(err) & (exp.abs() >= 2 * tiny)
    # +1 toward zero, -1 away from it, 0 for an exact or unjudged element; each unit's sum of
    # its elements' votes (whole numbers, exact in float64) points the way most of them err.
    vote = torch.where(judged, -torch.sign(err * exp.sign()), 0.0)
    unit = units.to(exp.device).long()
    votes = torch.zeros(int(unit.max().item()) + 1 if unit.numel() else 0, dtype=torch.float64, device=exp.device)
    # The votes of the elements sharing a unit entry (the dims ``units`` broadcasts over) are summed first.
    votes.index_add_(0, unit.reshape(-1), vote.sum_to_size(unit.shape).reshape(-1))
    n = int((votes != 0).sum().item())
    if n == 0:
        return 0.0, 0.0, 0
    toward = int((votes > 0).sum().item())
    return toward / n, (n - toward) / n, n


def rounding_direction_biased(actual: torch.Tensor, expected: torch.Tensor, units: torch.Tensor) -> str | None:
    """A sentence saying how ``actual`` errs one way, or None when consistent with round
    to nearest (or when too few units err to judge)."""
    toward, away, n = rounding_direction(actual, expected, units)
    if n < ROUNDING_DIRECTION_MIN_UNITS:
        return None
    for fraction, direction in ((toward, "toward zero"), (away, "away from zero")):
        if fraction > ROUNDING_DIRECTION_LIMIT:
            return (
                f"the errors of {fraction:.0%} of {n} independent units (blocks, groups or weight rows) point "
                f"{direction}; round to nearest errs both ways, and at most {ROUNDING_DIRECTION_LIMIT:.0%} "
                "may point one way"
            )
    return None

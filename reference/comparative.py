"""Comparative accuracy: a backend's error against torch's own dense op on the same weights.

The worst-case bounds (``bounds.matmul_bound``) are rigorous and loose: they allow every
rounding of a K-term dot product to err the same way, ``gamma_K(u_a) |x||W|^T``. Arithmetic
much worse than it should be passes inside them. This module asks a second question of the
same call: is the backend's error of the size that torch's own ``F.linear`` makes on the
*same decoded weights in the same dtypes*? Its truth is torch's dense op, beside the
float64 reference, not instead of it.

Statistic. For each output element ``i`` with the float64 magnitude
``s_i = (|x| |W|^T + |b|)_i > 0`` and a finite ``exact_i``, the normalised errors

    a_i = |actual_i - exact_i| / s_i          (the backend)
    t_i = |dense_i  - exact_i| / s_i          (torch's F.linear in the compute dtype)
    r_i = rounding_bound(exact_i, out) / s_i  (one rounding of the output: half an ulp)

and, with ``Q_p`` the ``p``-quantile over the elements,

    ratio = Q_p(a) / (max(Q_p(t), Q_p(r)) + Q_p(v))

A call fails when ``ratio > COMPARATIVE_FACTOR``. ``v_i`` is the backend's own weight rounding
beyond torch's (``weight_spread``, 0 when not given): torch multiplies by the exact decoding
rounded once to the compute dtype; a format whose decode legitimately rounds more (HQQ's
``(q - z) s`` in the compute dtype after rounding a wider zero and scale, bounded by the
weight error ``E`` of ``bounds.matmul_bound``) multiplies by a weight off by up to
``E' = max(E - rounding_bound(W), 0)`` more. Those errors are independent between weights,
so they add up as a random sum, not a worst case: ``v_i = sqrt(sum_k x_k^2 E'_ik^2) / s_i``
(the spread of ``sum_k x_k e_k`` with ``|e_k| <= E'_k`` is at most that). Measured: HQQ's
fp16 decode of an all-zero group (its zero point far from the codes) is off by ~7 % of
the group's values, inside its ``E`` of ~15 %, and its calls were up to 159 times torch's
error without this term and below 1 with it.

Why these choices (the model of ``bounds``: a rounding at unit roundoff ``u`` of a value
``v`` errs by ``u |v| d``, ``d`` spread over ``[-1, 1]``, independent between roundings).

- Dividing by ``s_i``: every rounding inside a dot product errs in proportion to the size of
  its operands, whose sum is ``s_i``; a large output and a small one are judged alike.
- The floor ``Q_p(r)``: torch may be exact by luck (a 16-bit output that happens to be
  representable, a tiny call). A backend that errs by one rounding of its output is never
  worse than that rounding, so its ratio against the floor is at most about 1: a correct
  backend cannot fail because torch was lucky.
- 16-bit outputs. Both errors are dominated by the final rounding: ``u |y|`` with
  ``|y| ~ sigma sqrt(K)`` (``sigma``: the spread of one product ``x_k w_k``), standard
  deviation ``u sigma sqrt(K) / sqrt(3)``. An fp32 accumulator adds ``~2**-24 sigma K``,
  nothing at the K of a linear layer. A correct backend differs from torch only where it
  rounds the other way (an output near a rounding tie) or where it decodes its weight with
  more roundings (HQQ's ``(q - z) s`` in bf16: two roundings of each weight and a rounded
  zero point, each adding ``~u sigma sqrt(K)``): its ratio sits near 1.
  A *sequential accumulator* of unit roundoff ``u`` instead rounds every partial sum
  ``s_j ~ sigma sqrt(j)``: ``sum_j u |s_j| d_j`` has standard deviation
  ``u sigma sqrt(sum_j j / 3) = u sigma K / sqrt(6)``, ``sqrt(K / 2)`` times the output
  rounding's: 8x at K = 128, 11x at K = 256, 22x at K = 1024 for a bf16 accumulator (an
  fp16 accumulator the same in its own ``u``, against fp16 outputs). A blocked accumulation
  (MMA trees of ``c`` products added exactly, then the blocks sequentially) divides that by
  ``sqrt(c)``.
- fp32 outputs. The final rounding is ``2**-24 |y|``; torch's error is its accumulation error,
  ``~2**-24 sigma sqrt(K)`` to ``~2**-24 sigma K / sqrt(6)`` depending on its blocking. Another
  correct summation order (a Triton tile, a pairwise sum) differs by a small factor; a
  TF32 product (``2**-11``) or a bf16 computation of an fp32 layer is 2**13 times worse.
- The quantile ``p = 0.9`` and the factor ``F = 3``. The ratio of two spreads is read at a
  high quantile, not at the maximum: a single element rounded the other way (one ulp
  instead of half an ulp) must not decide, and a mean would let a wrong tail hide behind
  a right bulk. At ``p = 0.9`` of ``n`` elements the quantile's relative sampling error is
  ``sqrt(p (1 - p) / n) / (q f(q))``, about 8 % at ``n = 64`` for the uniform output
  rounding and 20 % for a normal accumulation error. Against the half-ulp floor (the
  *largest* rounding error, not its typical size) the ratios come out lower than the spreads'
  ratios above: torch itself sits at 0.5-0.8 in 16 bits and at 1 in fp32, and a sequential
  bf16 or fp16 accumulator (simulated, normal data) at 3.2-4 for K = 64-128, 6-7 at K = 256
  and 15 at K = 1024; blocks of 16 exact products added sequentially at 1.2, 2.2 and 3.5-3.9.
  Correct backends measured on this project's 2-core AVX2 CPU (2026-11-28, the matmul suite's
  instances and draws; per cell, the worst): bitsandbytes <= 1.0, HQQ <= 0.8, triton-nf4 in
  the interpreter <= 1.25, the example's torch-nf4 <= 1.0 (HQQ without the weight-spread
  allowance above: 1.3-3.9, and 159 on the all-zero groups). ``F = 3`` is more than twice
  the worst of them and below every sequential 16-bit accumulator from K = 128 on; blocks of
  4 exact products added in bf16 or fp16 compare 3.5-3.9 at K = 256 (the zoo's
  ``mutant-bf16-running-sum``) and ~7.5 at K = 1024; MMA blocks of 16 at K = 1024 3.5-3.9, at
  K = 256 about 2 (not caught: at that size their error is not "several times torch's").
- Too few elements. Below ``MIN_ELEMENTS`` (16) output elements judged, a quantile is one
  of a handful of values: the call gets no comparative ratio (``ratio`` None), and the
  worst-case bound alone judges it. Elements with ``s_i = 0`` (a zero weight row and no
  bias: the output is exactly 0, which the bound holds to its underflow term) and
  non-finite references are left out. Above ``MAX_SAMPLE`` outputs the quantiles are read
  from an evenly strided sample of that many (cost: the whole of an lm_head call of 128 rows,
  19 M outputs, took seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pytest_qconform.reference.bounds import rounding_bound

__all__ = [
    "COMPARATIVE_FACTOR",
    "COMPARATIVE_QUANTILE",
    "MIN_ELEMENTS",
    "Comparison",
    "comparative_linear",
    "comparative_ratio",
    "dense_linear",
    "dense_grad_input",
    "magnitude",
    "weight_spread",
]

# A call fails when its p-quantile of normalised errors is more than this many times torch's
# (module docstring: correct backends sit at 1-2, a sequential 16-bit accumulator at sqrt(K/2)).
COMPARATIVE_FACTOR: float = 3.0
COMPARATIVE_QUANTILE: float = 0.9
MIN_ELEMENTS: int = 16
# Above this many outputs the quantiles are read from an evenly strided sample of them (an lm_head
# call is up to 19 M outputs): the 0.9-quantile of 16384 samples has a relative sampling error of
# sqrt(0.9 * 0.1 / 16384) / (q f(q)), 1-2 % for the distributions above.
MAX_SAMPLE: int = 16384
# A format's extra decode error below this fraction of one rounding of the weight is no allowance.
SPREAD_NEGLIGIBLE: float = 1 / 16


@dataclass(frozen=True)
class Comparison:
    """One call's comparative accuracy: ``ratio`` (None when too few elements to judge)
    and the three quantiles it is made of, normalised by the magnitude ``|x| |W|^T + |b|``."""

    ratio: float | None
    backend_error: float  # Q_p(|actual - exact| / s)
    torch_error: float  # Q_p(|dense - exact| / s)
    floor: float  # Q_p(rounding_bound(exact, out) / s)
    elements: int  # elements judged
    quantile: float = COMPARATIVE_QUANTILE
    weight: float = 0.0  # Q_p(v): the backend's weight roundings beyond torch's, relative to s

    @property
    def failed(self) -> bool:
        return self.ratio is not None and not self.ratio <= COMPARATIVE_FACTOR

    def describe(self, what: str = "F.linear") -> str:
        """A sentence: how the backend's error compares with torch's at the quantile."""
        pct = f"{self.quantile * 100:.0f}th percentile"
        if self.ratio is None:
            return f"{self.elements} elements: too few to compare with torch's own {what} (at least {MIN_ELEMENTS})"
        torch_side = max(self.torch_error, self.floor) + self.weight
        which = "its error" if self.torch_error >= self.floor else "one rounding of the output (torch's floor)"
        if self.weight:
            which += f" plus {self.weight:.3g} for the backend's own weight roundings"
        return (
            f"{self.ratio:.3g} x torch's own {what} error at the {pct} (backend {self.backend_error:.3g}, "
            f"torch {torch_side:.3g}: {which}; relative to |x||W|^T + |b|, over {self.elements} elements; "
            f"limit {COMPARATIVE_FACTOR:g} x)"
        )


def magnitude(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``s = |x| |W|^T + |b|`` in float64 on ``x``'s device, shape ``(..., N)``: what the
    roundings of a dot product err in proportion to."""
    x64 = x.detach().to(torch.float64).abs()
    w64 = w.detach().to(device=x.device, dtype=torch.float64).abs()
    s = x64.reshape(-1, x.shape[-1]) @ w64.T
    if b is not None:
        s = s + b.detach().to(device=x.device, dtype=torch.float64).abs()
    return s.reshape(*x.shape[:-1], w.shape[0])


@torch.no_grad()
def dense_linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, compute_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch's own ``F.linear(x.to(c), W.to(c), b.to(c)).to(out)`` with ``c = compute_dtype``,
    on ``x``'s device: the dense op a user would call on the same decoded weights, in the
    same dtypes. ``w`` and ``b`` are the float64 decodings (rounded once to ``c`` here)."""
    dev = x.device
    bias = None if b is None else b.detach().to(device=dev, dtype=compute_dtype)
    with torch.autocast(dev.type, enabled=False):  # in compute_dtype itself, under a caller's autocast too
        y = F.linear(x.detach().to(compute_dtype), w.detach().to(device=dev, dtype=compute_dtype), bias)
    return y.to(out_dtype)


@torch.no_grad()
def dense_grad_input(
    dy: torch.Tensor, w: torch.Tensor, compute_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch's own ``dx = dy W`` (``torch.matmul`` in ``compute_dtype``, returned in
    ``out_dtype``), what ``F.linear``'s backward computes on the same weight."""
    dev = dy.device
    with torch.autocast(dev.type, enabled=False):
        dx = torch.matmul(dy.detach().to(compute_dtype), w.detach().to(device=dev, dtype=compute_dtype))
    return dx.to(out_dtype)


def weight_spread(
    x: torch.Tensor, w: torch.Tensor, w_error: torch.Tensor | None, compute_dtype: torch.dtype
) -> torch.Tensor | None:
    """``sqrt(x^2 (E')^T)`` with ``E' = max(E - rounding_bound(W, c), 0)``: the spread that a
    backend's weight roundings beyond torch's one rounding to ``compute_dtype`` add to each
    output (module docstring), float64, shape ``(..., N)``. None without ``w_error`` (``E``),
    and where ``E'`` is nowhere above ``SPREAD_NEGLIGIBLE`` of one rounding (bitsandbytes'
    fp32 ``code * absmax`` rounded once: ``E'`` ~ ``2**-24 |W|``, against ``2**-8 |W|`` in bf16),
    which would move the floor by less than that fraction."""
    if w_error is None:
        return None
    w64 = w.detach().to(device=x.device, dtype=torch.float64)
    one = rounding_bound(w64, compute_dtype)
    extra = (w_error.detach().to(device=x.device, dtype=torch.float64) - one).clamp_min_(0)
    if not bool((extra > SPREAD_NEGLIGIBLE * one).any()):
        return None
    x2 = x.detach().to(torch.float64).reshape(-1, x.shape[-1]).square()
    return (x2 @ extra.square().T).sqrt().reshape(*x.shape[:-1], w.shape[0])


def _sample_step(numel: int) -> int:
    """The quantiles are read at every ``ceil(numel / MAX_SAMPLE)``-th flat position."""
    return max(1, -(-numel // MAX_SAMPLE))


@torch.no_grad()
def comparative_linear(
    actual: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    exact: torch.Tensor,
    compute_dtype: torch.dtype,
    *,
    w_error: torch.Tensor | None = None,
    dense: torch.Tensor | None = None,
) -> Comparison:
    """``comparative_ratio`` of a backend's ``actual = x W^T + b`` (``exact`` its float64
    value, ``w`` and ``b`` the float64 decodings), with torch's ``dense_linear`` (or the
    ``dense`` given: ``dense_grad_input`` for ``dx = dy W``, passed as ``x = dy``, ``w = W^T``),
    the magnitude and the ``weight_spread`` of ``w_error`` read only at the sampled outputs:
    an lm_head call's full ``|x| |W|^T`` in float64 cost more than the rest of the check."""
    if dense is None:
        dense = dense_linear(x, w, b, compute_dtype, actual.dtype)
    k, n_out = x.shape[-1], w.shape[0]
    rows = x.numel() // k if k else 0
    if rows * n_out <= MAX_SAMPLE:  # every output: the products' magnitudes as one small matmul
        spread = weight_spread(x, w, w_error, compute_dtype)
        return comparative_ratio(actual, dense, exact, magnitude(x, w, b), spread=spread)
    pick = torch.arange(0, rows * n_out, _sample_step(rows * n_out), device=x.device)
    r, c = pick // n_out, pick % n_out
    x_at = x.detach().reshape(rows, k)[r].to(torch.float64)  # (samples, K): the rows and weight rows they read
    w_at = w.detach()[c].to(device=x.device, dtype=torch.float64)
    scale = (x_at.abs() * w_at.abs()).sum(-1)
    if b is not None:
        scale = scale + b.detach().to(device=x.device, dtype=torch.float64)[c].abs()
    spread = None
    if w_error is not None:
        one = rounding_bound(w_at, compute_dtype)
        extra = (w_error.detach()[c].to(device=x.device, dtype=torch.float64) - one).clamp_min_(0)
        if bool((extra > SPREAD_NEGLIGIBLE * one).any()):
            spread = (x_at.square() * extra.square()).sum(-1).sqrt()

    def at_pick(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1)[pick]

    return comparative_ratio(at_pick(actual), at_pick(dense), at_pick(exact), scale, spread=spread)


def _quantile(values: torch.Tensor, p: float) -> float:
    """The ``p``-quantile (linear interpolation between order statistics, as ``torch.quantile``),
    through a sort: ``torch.quantile`` refuses more than 2**24 elements."""
    ordered = values.reshape(-1).sort().values
    pos = p * (ordered.numel() - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, ordered.numel() - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


@torch.no_grad()
def comparative_ratio(
    actual: torch.Tensor,
    dense: torch.Tensor,
    exact: torch.Tensor,
    scale: torch.Tensor,
    *,
    spread: torch.Tensor | None = None,
    quantile: float = COMPARATIVE_QUANTILE,
) -> Comparison:
    """The backend's ``actual`` against torch's ``dense`` (``dense_linear``), both against the
    float64 ``exact``, each error divided by ``scale`` (``magnitude``): ``Q_p`` of the
    backend's over ``max(Q_p`` of torch's, ``Q_p`` of one rounding of the output in
    ``actual``'s dtype) plus ``Q_p`` of ``spread / scale`` (``weight_spread``). Judged where ``scale > 0`` and ``exact`` is finite; a non-finite
    ``actual`` there counts an infinite error (the bound says so too, with its own message)."""
    shape = torch.broadcast_shapes(actual.shape, dense.shape, exact.shape, scale.shape)
    numel = math.prod(shape)
    step = _sample_step(numel)  # an evenly strided sample, taken before any float64 copy

    def sampled(t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().broadcast_to(shape).reshape(-1)[::step]
        return flat.to(device=exact.device, dtype=torch.float64)

    act, den, exp, s = sampled(actual), sampled(dense), sampled(exact), sampled(scale)
    judged = (s > 0) & torch.isfinite(exp) & torch.isfinite(s)
    n = int(judged.sum().item())
    s_j, e_j = s[judged], exp[judged]
    a = ((act[judged] - e_j).abs() / s_j).nan_to_num(nan=math.inf)
    t = ((den[judged] - e_j).abs() / s_j).nan_to_num(nan=math.inf)
    out_dtype = actual.dtype if actual.dtype.is_floating_point else torch.float32
    r = rounding_bound(e_j, out_dtype) / s_j
    if n == 0:
        return Comparison(None, 0.0, 0.0, 0.0, 0, quantile)
    qa, qt, qr = _quantile(a, quantile), _quantile(t, quantile), _quantile(r, quantile)
    qv = 0.0
    if spread is not None:
        v = sampled(spread)[judged] / s_j
        qv = _quantile(v.nan_to_num(nan=0.0), quantile)
    if n < MIN_ELEMENTS:
        return Comparison(None, qa, qt, qr, n, quantile, qv)
    ref = max(qt, qr) + qv
    ratio = qa / ref if ref > 0 else (0.0 if qa == 0 else math.inf)
    return Comparison(ratio, qa, qt, qr, n, quantile, qv)

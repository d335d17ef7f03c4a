"""The comparative check (``reference.comparative``) separates fp32 accumulation from
reduced-precision accumulation where the worst-case bound cannot.

At K = 1024 a matmul whose products are exact (fp32) but whose running sum is kept in bf16
or fp16 (blocks of 4 products added exactly, the blocks added one by one in the 16-bit
dtype: a kernel with a 16-bit accumulator register) stays inside ``bounds.matmul_bound``
(shown below: the bound alone misses it) and is ~5-8 times torch's own ``F.linear`` error
(module docstring: ``sqrt(K / 2) / sqrt(4)`` times the output rounding's spread). The
same blocks summed in fp32 pass both.
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds, comparative, linear

K = 1024


def _blocked_sum(x: torch.Tensor, w: torch.Tensor, accumulate: torch.dtype, block: int = 4) -> torch.Tensor:
    """``x W^T`` with exact fp32 products, ``block`` of them summed in fp32, the block sums
    added sequentially in ``accumulate``: a reduced-precision accumulator when 16-bit."""
    products = x.float().unsqueeze(-2) * w.float()  # (M, N, K), exact for 16-bit inputs
    blocks = products.reshape(*products.shape[:-1], -1, block).sum(-1)
    total = torch.zeros(blocks.shape[:-1], dtype=accumulate)
    for j in range(blocks.shape[-1]):
        total = total + blocks[..., j].to(accumulate)
    return total


def _case(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, K, generator=gen).to(dtype)
    w = torch.randn(64, K, generator=gen).to(dtype).double()  # exact in dtype: torch's weight is W itself
    return x, w


def _judged(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(bound multiple, comparative ratio) of ``y`` for ``x W^T`` computed in ``dtype``."""
    exact = linear.linear(x.double(), w)
    bound = bounds.matmul_bound(x.double(), w, None, dtype, dtype, exact=exact)
    found = comparative.comparative_ratio(
        y, comparative.dense_linear(x, w, None, dtype, dtype), exact, comparative.magnitude(x, w)
    )
    assert found.ratio is not None
    return bounds.error_multiple(y, exact, bound), found.ratio


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seed", (0, 1))
def test_reduced_precision_accumulation_passes_the_bound_and_fails_the_comparison(dtype, seed) -> None:
    x, w = _case(dtype, seed)
    multiple, ratio = _judged(_blocked_sum(x, w.to(dtype), dtype).to(dtype), x, w, dtype)
    assert multiple <= bounds.BOUND_MULTIPLE, f"the bound alone catches it ({multiple:.3g}): not the case to show"
    assert ratio > comparative.COMPARATIVE_FACTOR, f"a {dtype} accumulator at K={K} compares {ratio:.3g} x torch"


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("seed", (0, 1))
def test_fp32_accumulation_passes_both(dtype, seed) -> None:
    x, w = _case(dtype, seed)
    multiple, ratio = _judged(_blocked_sum(x, w.to(dtype), torch.float32).to(dtype), x, w, dtype)
    assert multiple <= bounds.BOUND_MULTIPLE
    assert ratio <= comparative.COMPARATIVE_FACTOR / 2, f"fp32 accumulation compares {ratio:.3g} x torch"


def test_torch_against_itself_is_at_most_one_rounding() -> None:
    """torch's own result compared with itself: its error is at most the half-ulp floor."""
    x, w = _case(torch.bfloat16, 2)
    exact = linear.linear(x.double(), w)
    dense = comparative.dense_linear(x, w, None, torch.bfloat16, torch.bfloat16)
    found = comparative.comparative_ratio(dense, dense, exact, comparative.magnitude(x, w))
    assert found.ratio is not None and found.ratio <= 1.0


def test_too_few_elements_are_not_compared() -> None:
    x, w = _case(torch.bfloat16, 3)
    x, w = x[:1], w[: comparative.MIN_ELEMENTS - 1]
    exact = linear.linear(x.double(), w)
    y = _blocked_sum(x, w.to(torch.bfloat16), torch.bfloat16)
    dense = comparative.dense_linear(x, w, None, torch.bfloat16, torch.bfloat16)
    found = comparative.comparative_ratio(y, dense, exact, comparative.magnitude(x, w))
    assert found.ratio is None and not found.failed and "too few" in found.describe()


def test_weight_spread_allows_a_formats_own_decode_roundings() -> None:
    """A backend multiplying by a weight off by up to E (its format's decode: more roundings
    than torch's one) is judged against torch plus that spread, not against torch alone."""
    x, w = _case(torch.bfloat16, 4)
    u = bounds.unit_roundoff(torch.bfloat16)
    w_error = 8 * u * w.abs()  # a coarse decode: up to 8 roundings' worth per weight
    gen = torch.Generator().manual_seed(5)
    noisy = w * (1 + (torch.rand(w.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 7 * u)
    y = linear.linear(x.double(), noisy).to(torch.bfloat16)
    exact = linear.linear(x.double(), w)
    dense = comparative.dense_linear(x, w, None, torch.bfloat16, torch.bfloat16)
    scale = comparative.magnitude(x, w)
    alone = comparative.comparative_ratio(y, dense, exact, scale)
    allowed = comparative.comparative_ratio(
        y, dense, exact, scale, spread=comparative.weight_spread(x, w, w_error, torch.bfloat16)
    )
    assert alone.failed and not allowed.failed, (alone, allowed)


def test_failure_message_names_the_percentile_and_torch() -> None:
    x, w = _case(torch.bfloat16, 0)
    exact = linear.linear(x.double(), w)
    y = _blocked_sum(x, w.to(torch.bfloat16), torch.bfloat16, block=1).to(torch.bfloat16)
    dense = comparative.dense_linear(x, w, None, torch.bfloat16, torch.bfloat16)
    found = comparative.comparative_ratio(y, dense, exact, comparative.magnitude(x, w))
    assert found.failed
    assert "x torch's own F.linear error at the 90th percentile" in found.describe()


def test_comparative_linear_reads_the_same_ratio_as_the_full_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``MAX_SAMPLE`` outputs ``comparative_linear`` gathers the magnitudes at the sampled
    outputs only; ``comparative_ratio`` of the full tensors samples the same positions."""
    monkeypatch.setattr(comparative, "MAX_SAMPLE", 50)
    x, w = _case(torch.bfloat16, 6)
    b = torch.randn(64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).double()
    y = (_blocked_sum(x, w.to(torch.bfloat16), torch.bfloat16) + b.to(torch.bfloat16)).to(torch.bfloat16)
    exact = linear.linear(x.double(), w, b)
    dense = comparative.dense_linear(x, w, b, torch.bfloat16, torch.bfloat16)
    whole = comparative.comparative_ratio(y, dense, exact, comparative.magnitude(x, w, b))
    sampled = comparative.comparative_linear(y, x, w, b, exact, torch.bfloat16)
    assert sampled.ratio == pytest.approx(whole.ratio, rel=1e-9)

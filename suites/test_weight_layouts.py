"""Weight layouts: transposed, sliced and offset views passed to quantize as users pass them.

A weight is not always a fresh contiguous tensor: a tied embedding used as an output
projection is a transpose, a fused QKV weight is cut into row and column slices, a
shard starts at an offset in a larger storage. Adapters hand the view over unchanged
(no ``.contiguous()`` in front of the library), and the backend must either quantize the
logical values (as the quantize suite checks them) or refuse with an error that names
the layout. Reading the storage in memory order, silently, fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from pytest_qconform.cases.axes import WEIGHT_LAYOUTS
from pytest_qconform.cases.strategies import WeightCase, listed_weight, weight_cases, with_examples

from ._cases import dtype_id, packed_dequantize_bound, reference_decode, require_claim
from ._quantizer import check_source_quantization

pytestmark = pytest.mark.qconform_operation("quantize-layout")

# Words an error must contain to count as a clear refusal of the layout.
LAYOUT_WORDS = ("contiguous", "stride", "layout", "transpos")


def strided_view(values: torch.Tensor, layout: str) -> torch.Tensor:
    """``values`` (2-D) as a non-contiguous view holding the same logical values."""
    n, k = values.shape
    if layout == "transposed":  # storage holds W^T: W[i, j] at j * n + i
        return values.t().contiguous().t()
    if layout == "column-strided":  # every other column of a wider tensor
        wide = torch.zeros(n, 2 * k, dtype=values.dtype, device=values.device)
        wide[:, ::2] = values
        return wide[:, ::2]
    if layout == "offset-rows":  # rows of a wider tensor, starting at an offset (a shard of a fused weight)
        wide = torch.zeros(n + 1, k + 3, dtype=values.dtype, device=values.device)
        wide[1:, 3:] = values
        return wide[1:, 3:]
    raise ValueError(f"unknown layout {layout!r}; known: {WEIGHT_LAYOUTS}")


@pytest.mark.qconform_axes(
    "format",
    "blocksize",
    "double_quant",
    "hqq_axis",
    "dtype",
    "weight_layout",
    "weight_shape",
    "distribution",
    distribution=("normal", "outliers"),
)
def test_strided_weight_quantizes_like_its_contiguous_copy(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_layout, weight_shape, distribution
):
    """Each layout: the state quantized from the view passes the quantize suite's checks
    of the logical values (bitsandbytes layout: codes and absmax against the reference
    quantizer; HQQ: codes the nearest levels of its scale and zero; a floating-point
    reduction may legitimately run in another order over a strided tensor, so HQQ's scale
    need not be bit-identical to the contiguous copy's), and its dequantize is within
    bound of the reference decoding. ``dtype`` is the weight's; the weight's shape and
    distribution are the instance's (listed with a fixed seed, then drawn seeds)."""
    require_claim(qbackend, qtarget, spec, dtype, dequantize=True)

    @with_examples([{"case": listed_weight(weight_shape, distribution)}])
    @given(case=weight_cases((weight_shape,), (distribution,)))
    def check(case: WeightCase):
        layout = weight_layout
        qcheck.describe(**case.describe(), layout=layout, weight_dtype=dtype_id(dtype))
        weight = case.make(qdevice).to(dtype)
        view = strided_view(weight, layout)
        assert torch.equal(view, weight)  # (a 1-row weight's transpose is still contiguous)
        try:  # the library's own call: what it raises is a refusal to judge, not a check's verdict
            quantized = qbackend.unchecked.quantize(view, spec)
        except Exception as exc:  # noqa: BLE001 - a clear refusal passes, anything else is reported
            if not any(word in str(exc).lower() for word in LAYOUT_WORDS):
                raise AssertionError(
                    f"quantize of a {layout} weight raised an error that does not name the "
                    f"layout: {type(exc).__name__}: {exc}; " + qcheck._where()
                ) from exc
            qcheck.record_multiple(0.0)
            return
        qcheck.faithful(qbackend.export_packed(quantized), view, f"{qbackend.name}.quantize of a {layout} view")
        packed = check_source_quantization(qbackend, qcheck, spec, view, qdevice, quantized)
        exact = reference_decode(packed, qdevice)
        out = qbackend.dequantize(quantized, dtype)
        qcheck.within(
            out,
            exact,
            packed_dequantize_bound(packed, exact, dtype),
            f"dequantize of the state quantized from a {layout} view",
        )

    check()

"""The HQQ 4-bit reference: row-half packing, grouping by axis, decoding.

Hand-computed cases pin the layout; then the real hqq on CPU: the reference decodes
``HQQLinear``'s own ``W_q``, scale and zero within the derived bound of its
``dequantize()``, for both axes and each compute dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bounds, hqq4
from pytest_qconform.reference.packed import PackedHqq4


def test_unpack_4bit_u8_high_nibbles_are_the_first_half_of_rows():
    packed = np.array([[0x12, 0x34]], dtype=np.uint8)
    assert hqq4.unpack_4bit_u8(packed).tolist() == [[1, 3], [2, 4]]


def test_unpack_rejects_non_uint8():
    with pytest.raises(ValueError, match="expected uint8 bytes, got float32"):
        hqq4.unpack_4bit_u8(np.zeros((1, 2), dtype=np.float32))


def test_grouped_shape_by_axis():
    assert hqq4.grouped_shape((64, 128), 64, axis=1) == (128, 64)
    assert hqq4.grouped_shape((64, 128), 64, axis=0) == (64, 128)
    with pytest.raises(ValueError, match="divisible by group_size 64"):
        hqq4.grouped_shape((3, 7), 64, axis=1)


def test_decode_axis1_by_hand():
    # shape (2, 4), groups of 2 along rows of Q (4, 2):
    #   Q = [[0, 1], [2, 3], [4, 5], [15, 14]]; packed row r = Q[r] << 4 | Q[r + 2].
    packed = np.array([[0x04, 0x15], [0x2F, 0x3E]], dtype=np.uint8)
    p = PackedHqq4(
        shape=(2, 4),
        group_size=2,
        axis=1,
        packed=packed,
        scale=np.array([[1.0], [2.0], [0.5], [1.0]]),
        zero=np.array([[0.0], [1.0], [0.0], [8.0]]),
    )
    out = hqq4.decode(p)
    assert out.dtype == torch.float64
    assert out.tolist() == [[0.0, 1.0, 2.0, 4.0], [2.0, 2.5, 7.0, 6.0]]


def test_decode_axis0_by_hand():
    # shape (2, 4), groups of 2 along columns of Q (2, 4): Q = [[1, 2, 3, 4], [5, 6, 7, 8]].
    packed = np.array([[0x15, 0x26, 0x37, 0x48]], dtype=np.uint8)
    p = PackedHqq4(
        shape=(2, 4),
        group_size=2,
        axis=0,
        packed=packed,
        scale=np.array([[1.0, 1.0, 2.0, 2.0]]),
        zero=np.array([[0.0, 1.0, 0.0, 1.0]]),
    )
    assert hqq4.decode(p).tolist() == [[1.0, 1.0, 6.0, 6.0], [5.0, 5.0, 14.0, 14.0]]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"shape": (1, 4), "group_size": 4}, "odd row count"),
        ({"packed": np.zeros((1, 3), dtype=np.uint8)}, "expected \\(R/2\\) \\* C = 4"),
        ({"scale": np.ones(3)}, "scale has 3 entries, expected one per group \\(4\\)"),
        ({"packing": "2bit_u8"}, "knows the '4bit_u8' packing only"),
    ],
)
def test_decode_rejects_inconsistent_records(change, message):
    base = dict(
        shape=(2, 4),
        group_size=2,
        axis=1,
        packed=np.zeros((2, 2), dtype=np.uint8),
        scale=np.ones((4, 1)),
        zero=np.zeros((4, 1)),
    )
    with pytest.raises(ValueError, match=message):
        hqq4.decode(PackedHqq4(**{**base, **change}))


# --- against hqq on CPU ------------------------------------------------------------

HQQ_CASES = [((64, 128), axis, dtype) for axis in (1, 0) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
HQQ_CASES += [((16, 256), 0, torch.float32)]


@pytest.mark.parametrize(
    "shape,axis,compute_dtype", HQQ_CASES, ids=lambda v: str(v).replace("torch.", "").replace(" ", "")
)
def test_reference_decodes_hqq_bytes_within_bound(shape, axis, compute_dtype):
    quantize = pytest.importorskip("hqq.core.quantize")
    bitpack = pytest.importorskip("hqq.core.bitpack")
    torch.manual_seed(0)
    layer = torch.nn.Linear(shape[1], shape[0], bias=False)
    q = quantize.HQQLinear(
        layer, quantize.BaseQuantizeConfig(nbits=4, group_size=64, axis=axis), compute_dtype=compute_dtype, device="cpu"
    )
    assert q.meta["packing"] == "4bit_u8" and not q.meta["view_as_float"]
    p = PackedHqq4(
        shape=tuple(q.meta["shape"]),
        group_size=64,
        axis=axis,
        packed=q.W_q.numpy(),
        scale=q.meta["scale"].float().numpy(),
        zero=q.meta["zero"].float().numpy(),
        meta={"compute_dtype": str(compute_dtype)},
    )
    # The unpacking agrees with hqq's own.
    theirs = bitpack.BitPack.unpack_4bit_u8(q.W_q, dtype=torch.uint8).numpy()
    assert np.array_equal(hqq4.unpack_4bit_u8(p.packed), theirs)
    out = q.dequantize()
    exact = hqq4.decode(p)
    assert out.dtype == compute_dtype and exact.shape == out.shape == shape
    bound = bounds.dequantize_bound(exact, out.dtype, intermediate=compute_dtype, ops=2)
    assert bounds.error_multiple(out, exact, bound) <= bounds.BOUND_MULTIPLE
    # The comparison can fail: decoding along the other axis is caught.
    other = 1 - axis
    rows, cols = hqq4.grouped_shape(shape, 64, other)
    wrong = PackedHqq4(
        shape=shape,
        group_size=64,
        axis=other,
        packed=p.packed.reshape(rows // 2, cols),
        scale=np.resize(p.scale.reshape(-1), rows if other == 1 else cols),
        zero=np.resize(p.zero.reshape(-1), rows if other == 1 else cols),
    )
    assert bounds.error_multiple(out, hqq4.decode(wrong), bound) > 1

"""The bitsandbytes-layout reference: code tables, packing, decoding, quantizing.

Hand-computed cases first (they pin the layout without any backend), then the real
bitsandbytes on CPU: the reference must decode its bytes within the derived bound and
reproduce its codes (by value, ties aside) and absmax. Few shapes: bitsandbytes'
CPU path torch.compiles per shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4, bounds
from pytest_qconform.reference.formats import FP4_CODE, NF4_CODE, code_table, dynamic_map_signed
from pytest_qconform.reference.packed import PackedBnb4

U32 = bounds.unit_roundoff(torch.float32)


# --- tables ------------------------------------------------------------------------


def test_nf4_table_is_sorted_float32_with_exact_zero_and_unit_ends():
    assert len(NF4_CODE) == 16
    assert list(NF4_CODE) == sorted(NF4_CODE)
    assert (NF4_CODE[0], NF4_CODE[7], NF4_CODE[15]) == (-1.0, 0.0, 1.0)
    assert all(float(np.float32(v)) == v for v in NF4_CODE)
    # 7 negative and 8 positive quantiles (QLoRA's asymmetric construction).
    assert sum(v < 0 for v in NF4_CODE) == 7 and sum(v > 0 for v in NF4_CODE) == 8


def test_fp4_table_is_e2m1_bit_patterns_divided_by_12_in_float32():
    magnitude = {0b000: 0.0, 0b001: 0.0625, 0b010: 8.0, 0b011: 12.0, 0b100: 4.0, 0b101: 6.0, 0b110: 2.0, 0b111: 3.0}
    for code in range(16):
        sign = -1.0 if code & 0b1000 else 1.0
        expected = float(np.float32(sign * magnitude[code & 0b111]) / np.float32(12.0))
        assert FP4_CODE[code] == expected, f"FP4 code {code:#06b}"


def test_code_table_rejects_unknown_format():
    assert code_table("nf4") is NF4_CODE
    with pytest.raises(ValueError, match="unknown 4-bit quant_type 'int4'"):
        code_table("int4")


def test_dynamic_map_has_256_sorted_entries_from_its_definition():
    dm = dynamic_map_signed()
    assert len(dm) == 256 and list(dm) == sorted(dm)
    assert dm[-1] == 1.0 and dm.count(0.0) == 1
    assert sum(v > 0 for v in dm) == 128 and sum(v < 0 for v in dm) == 127
    # Smallest magnitude: exponent 10**-6 times the midpoint of linspace(0.1, 1, 2).
    assert min(abs(v) for v in dm if v) == pytest.approx(0.55e-6, rel=1e-6)
    # Exponent 10**0 has 64 midpoints of linspace(0.1, 1, 65): the largest below 1 is
    # 1 - 0.9 / 128, rounded to float32.
    assert dm[-2] == float(np.float32(1 - 0.9 / 128))


def test_dynamic_map_equals_bitsandbytes():
    functional = pytest.importorskip("bitsandbytes.functional")
    assert list(dynamic_map_signed()) == functional.create_dynamic_map(signed=True).tolist()


# --- packing -----------------------------------------------------------------------


def test_unpack_puts_first_element_in_high_nibble():
    # 0x7F: element 0 = 7 (high), element 1 = 15 (low); 0xA0: element 2 = 10, low nibble padding.
    codes = bnb4.unpack_codes(np.array([0x7F, 0xA0], dtype=np.uint8), 3)
    assert codes.tolist() == [7, 15, 10] and codes.dtype == np.uint8


def test_pack_is_inverse_of_unpack_for_odd_numel():
    codes = np.array([1, 2, 3, 4, 5, 15, 0], dtype=np.uint8)
    packed = bnb4.pack_codes(codes)
    assert packed.tolist() == [0x12, 0x34, 0x5F, 0x00]
    assert bnb4.unpack_codes(packed, 7).tolist() == codes.tolist()


def test_unpack_reads_other_quant_storage_as_bytes():
    as_uint8 = np.array([0x12, 0x34, 0x56, 0x78], dtype=np.uint8)
    assert bnb4.unpack_codes(as_uint8.view(np.float32), 8).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_unpack_and_pack_reject_bad_input():
    with pytest.raises(ValueError, match="cannot hold 5 4-bit codes"):
        bnb4.unpack_codes(np.zeros(2, dtype=np.uint8), 5)
    with pytest.raises(ValueError, match="codes must be in 0..15"):
        bnb4.pack_codes(np.array([16]))


# --- decoding ----------------------------------------------------------------------


def _packed(codes, absmax, blocksize, shape, quant_type="nf4", **nested) -> PackedBnb4:
    return PackedBnb4(
        quant_type=quant_type,
        blocksize=blocksize,
        shape=shape,
        packed=bnb4.pack_codes(np.array(codes, dtype=np.uint8)),
        absmax=np.asarray(absmax),
        code=np.asarray(code_table(quant_type), dtype=np.float32),
        **nested,
    )


def test_decode_by_hand_with_partial_last_block_and_odd_numel():
    p = _packed([7, 15, 10], np.array([2.0, 0.5], dtype=np.float32), blocksize=2, shape=(3,))
    out = bnb4.decode(p)
    assert out.dtype == torch.float64 and out.shape == (3,)
    assert out.tolist() == [0.0, 2.0, 0.24611230194568634 * 0.5]


def test_decode_fp4_by_hand_and_reshapes():
    # codes 3 (+1), 9 (-0.0625/12), 13 (-0.5), 8 (-0) in one block of absmax 3.
    p = _packed([3, 9, 13, 8], np.array([3.0], dtype=np.float32), blocksize=64, shape=(2, 2), quant_type="fp4")
    assert bnb4.decode(p).tolist() == [[3.0, FP4_CODE[9] * 3.0], [-1.5, 0.0]]


def test_decode_ignores_the_backends_table_and_uses_the_formats():
    p = _packed([15], np.array([1.0], dtype=np.float32), blocksize=64, shape=(1,))
    wrong_table = PackedBnb4(**{**p.__dict__, "code": np.zeros(16, dtype=np.float32)})
    assert bnb4.decode(wrong_table).tolist() == [1.0]


def test_decode_absmax_double_quantized_by_hand():
    dm = np.asarray(dynamic_map_signed(), dtype=np.float32)
    p = _packed(
        [0] * 6,
        np.array([255, 0, 127], dtype=np.uint8),
        blocksize=2,
        shape=(6,),
        nested_absmax=np.array([2.0], dtype=np.float32),
        nested_code=dm,
        nested_blocksize=256,
        offset=0.5,
    )
    # nested_code[255] = 1, nested_code[127] = 0 (127 negatives sort below it).
    assert bnb4.decode_absmax(p).tolist() == [2.5, float(dm[0]) * 2.0 + 0.5, 0.5]


def test_decode_rejects_wrong_absmax_count():
    p = _packed([0] * 5, np.ones(2, dtype=np.float32), blocksize=2, shape=(5,))
    with pytest.raises(ValueError, match=r"expected ceil\(5 / 2\) = 3"):
        bnb4.decode(p)


# --- quantizing --------------------------------------------------------------------


def test_quantize_by_hand_nearest_code():
    codes, absmax = bnb4.quantize(torch.tensor([0.0, 0.5, -1.0, 2.0]), "nf4", 4)
    # scaled [0, .25, -.5, 1]: 0.25 is nearest 0.2461 (code 10), -0.5 nearest -0.5251 (code 2).
    assert codes.tolist() == [7, 10, 2, 15] and absmax.tolist() == [2.0]


def test_quantize_exact_tie_takes_the_lower_code():
    up = NF4_CODE[8] / 2  # exact midpoint of codes 7 (0) and 8
    down = NF4_CODE[6] / 2  # exact midpoint of codes 6 and 7 (0)
    codes, _ = bnb4.quantize(torch.tensor([up, 1.0, down, 1.0], dtype=torch.float64), "nf4", 2)
    assert codes.tolist() == [7, 15, 6, 15]


def test_quantize_fp4_zero_takes_the_sign_of_the_value():
    codes, _ = bnb4.quantize(torch.tensor([1e-4, -1e-4, 0.0, 1.0]), "fp4", 4)
    assert codes.tolist() == [0, 8, 0, 3]


def test_quantize_all_zero_block_gives_zero_absmax_and_zero_code():
    codes, absmax = bnb4.quantize(torch.zeros(5), "nf4", 4)
    assert codes.tolist() == [7] * 5 and absmax.tolist() == [0.0, 0.0]


def test_encode_decode_round_trip_is_code_times_float32_absmax():
    w = torch.randn(7, 9, generator=torch.Generator().manual_seed(3))
    p = bnb4.encode(w, "nf4", 32)
    codes, absmax = bnb4.quantize(w, "nf4", 32)
    expected = bnb4.code_values(codes, "nf4") * absmax.float().double().repeat_interleave(32)[: w.numel()]
    assert torch.equal(bnb4.decode(p).reshape(-1), expected)
    assert p.shape == (7, 9) and p.packed.size == 32


def test_quantize_rejects_nonfinite_weight():
    with pytest.raises(ValueError, match="NaN or Inf"):
        bnb4.quantize(torch.tensor([1.0, float("nan")]), "nf4", 64)


# --- against bitsandbytes on CPU ---------------------------------------------------


def _bnb_weight(shape) -> torch.Tensor:
    """Normal weights with outliers (so double quantization cancels) and a zero block."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    w.view(-1)[::97] *= 30
    w.view(-1)[:64] = 0
    return w


def _from_bnb(packed: torch.Tensor, state) -> PackedBnb4:
    nested = state.state2 if state.nested else None
    return PackedBnb4(
        quant_type=state.quant_type,
        blocksize=int(state.blocksize),
        shape=tuple(state.shape),
        packed=packed.numpy().reshape(-1),
        absmax=state.absmax.numpy(),
        code=state.code.numpy(),
        nested_absmax=None if nested is None else nested.absmax.numpy(),
        nested_code=None if nested is None else nested.code.numpy(),
        nested_blocksize=None if nested is None else int(nested.blocksize),
        offset=None if nested is None else float(state.offset),
    )


def _near_tie(quant_type: str, scaled: torch.Tensor) -> torch.Tensor:
    values = torch.tensor(sorted(set(code_table(quant_type))), dtype=torch.float64)
    midpoints = (values[1:] + values[:-1]) / 2
    distance = (scaled.unsqueeze(-1) - midpoints).abs().min(dim=-1).values
    return distance <= 8 * U32 * (1 + scaled.abs())


BNB_CASES = [
    (shape, qt, bs, dq, dtype)
    for shape in [(64, 128)]
    for qt in ("nf4", "fp4")
    for bs in (64, 128)
    for dq in (False, True)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
]
# One odd shape (partial last block, odd numel, bitsandbytes' fallback path); compiles once.
BNB_CASES += [((33, 17), "nf4", 64, dq, torch.float32) for dq in (False, True)]


@pytest.mark.parametrize(
    "shape,quant_type,blocksize,double_quant,dtype",
    BNB_CASES,
    ids=lambda v: str(v).replace("torch.", "").replace(" ", ""),
)
def test_reference_decodes_bitsandbytes_bytes_within_bound(shape, quant_type, blocksize, double_quant, dtype):
    functional = pytest.importorskip("bitsandbytes.functional")
    w = _bnb_weight(shape).to(dtype)
    packed, state = functional.quantize_4bit(
        w, blocksize=blocksize, quant_type=quant_type, compress_statistics=double_quant
    )
    out = functional.dequantize_4bit(packed, state)
    p = _from_bnb(packed, state)
    exact = bnb4.decode(p)
    assert out.dtype == dtype and exact.shape == out.shape
    assert bounds.error_multiple(out, exact, bounds.bnb4_dequantize_bound(p, dtype)) <= bounds.BOUND_MULTIPLE
    if not double_quant:
        ops_bound = bounds.dequantize_bound(exact, dtype, intermediate=torch.float32, ops=1)
        assert bounds.error_multiple(out, exact, ops_bound) <= bounds.BOUND_MULTIPLE
    # The comparison can fail: reading the nibbles the wrong way round is caught.
    swapped = PackedBnb4(**{**p.__dict__, "packed": ((p.packed << 4) | (p.packed >> 4)).astype(np.uint8)})
    assert bounds.error_multiple(out, bnb4.decode(swapped), bounds.bnb4_dequantize_bound(p, dtype)) > 1

    codes, absmax = bnb4.quantize(w, quant_type, blocksize)
    got = bnb4.unpack_codes(p.packed, w.numel())
    flat = w.double().reshape(-1)
    block_absmax = absmax.repeat_interleave(blocksize)[: w.numel()]
    scaled = torch.where(block_absmax > 0, flat / block_absmax.clamp_min(1e-300), 0.0)
    differ = bnb4.code_values(codes, quant_type) != bnb4.code_values(got, quant_type)
    assert not bool((differ & ~_near_tie(quant_type, scaled)).any()), "a non-tie code differs from bitsandbytes'"
    assert bool((torch.as_tensor(codes.astype(np.int64)) == torch.as_tensor(got.astype(np.int64))).float().mean() > 0.9)
    if not double_quant:
        stored = torch.as_tensor(state.absmax.double())
        assert torch.equal(stored, absmax), "bitsandbytes' float32 absmax is the exact block max |w|"

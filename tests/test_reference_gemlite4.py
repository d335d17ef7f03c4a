"""The gemlite 4-bit reference (an HQQ layer converted by gemlite): word layout, modes, bounds.

gemlite needs a GPU, so these pin the layout by hand: words packed as gemlite's
``pack_weights_over_cols`` documents it (code ``j`` of word ``c`` in bits ``4 j``, the
words transposed to ``(K / 8, N)``), decoded back; then a real HQQ layer on the CPU,
packed the way ``A16Wn.from_hqqlinear`` converts it, decodes to HQQ's own weight within
the derived bound (``gemlite_packing`` writes the conversion out).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gemlite_packing import convert_like_gemlite, hqq_state, pack_like_gemlite, reversed_nibbles
from pytest_qconform.reference import bounds, faithful, gemlite4, hqq4
from pytest_qconform.reference.packed import PackedGemlite4


def test_unpack_over_cols_code_j_of_a_word_is_input_feature_8c_plus_j():
    codes = np.arange(2 * 16, dtype=np.uint8).reshape(2, 16) % 16
    words = pack_like_gemlite(codes)
    assert words.shape == (2, 2)
    assert int(words.view(np.uint32)[0, 0]) == 0x76543210  # row 0, features 0..7, feature 0 lowest
    assert gemlite4.unpack_over_cols(words, 16).tolist() == codes.tolist()


def test_unpack_over_cols_reads_the_top_nibble_of_a_negative_word():
    codes = np.full((1, 8), 15, dtype=np.uint8)
    words = pack_like_gemlite(codes)
    assert int(words[0, 0]) == -1
    assert gemlite4.unpack_over_cols(words, 8).tolist() == codes.tolist()


def test_unpack_rejects_a_word_count_that_does_not_match_in_features():
    with pytest.raises(ValueError, match="expected in_features = 24"):
        gemlite4.unpack_over_cols(np.zeros((2, 3), dtype=np.int32), 24)


def _hand_state(mode: int) -> tuple[PackedGemlite4, np.ndarray]:
    """N=2, K=32, group 16; the expected float64 weight written out per element."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(2, 32)).astype(np.uint8)
    scale = np.array([[0.5, 0.25], [2.0, 1.0]], dtype=np.float32)  # (K/g, N)
    zero = np.array([[7.5, -3.0], [1.0, 0.125]], dtype=np.float32)
    expected = np.empty((2, 32))
    for n in range(2):
        for k in range(32):
            s, z = float(scale[k // 16, n]), float(zero[k // 16, n])
            expected[n, k] = (codes[n, k] - z) * s if mode == 3 else codes[n, k] * s + z
    state = PackedGemlite4((2, 32), 16, pack_like_gemlite(codes), scale, zero, group_mode=mode)
    return state, expected


@pytest.mark.parametrize("mode", (3, 4))
def test_decode_each_group_mode_by_hand(mode):
    state, expected = _hand_state(mode)
    assert gemlite4.decode(state).tolist() == expected.tolist()
    assert faithful.decode(state, "cpu").tolist() == expected.tolist()


def test_hqq_parts_give_mode_4_back_in_hqq_convention():
    state, expected = _hand_state(4)
    q, zero, scale = gemlite4.hqq_parts(state)
    assert torch.allclose((q - zero) * scale, torch.as_tensor(expected), rtol=0, atol=1e-12)


def test_decode_refuses_modes_it_does_not_know():
    state, _ = _hand_state(3)
    post_scaled = PackedGemlite4(state.shape, 16, state.packed, state.scale, state.zero, 1, channel_scale_mode=1)
    with pytest.raises(ValueError, match="W_group_mode 1 with channel_scale_mode 1 is not decoded"):
        gemlite4.decode(post_scaled)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_a_converted_hqq_layer_decodes_to_hqqs_weight_within_the_bounds(dtype):
    pytest.importorskip("hqq")
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    linear = torch.nn.Linear(64, 8, bias=False)
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    linear.weight.data = weight.clone()
    layer = HQQLinear(linear, BaseQuantizeConfig(nbits=4, group_size=32, axis=1), compute_dtype=dtype, device="cpu")
    hqq_parts = hqq_state(layer)
    converted = convert_like_gemlite(hqq_parts, dtype)
    hqq_exact, gemlite_exact = hqq4.decode(hqq_parts), gemlite4.decode(converted)
    # the conversion rounds -zero * scale once into the layer's dtype: within u |zero * scale|
    _, zero, scale = hqq4.decode_parts(hqq_parts)
    conversion = bounds.rounding_bound(zero * scale, dtype)
    assert bool(((gemlite_exact - hqq_exact).abs() <= conversion).all())
    # gemlite's kernels' fma in the layer's dtype, emulated in float32 then rounded, is within its bound
    q, zero_fma, scale_g = gemlite4.decode_parts(converted)
    kernel = (q.float() * scale_g.float() + zero_fma.float()).to(dtype).double()
    bound = bounds.gemlite4_dequantize_bound(converted, dtype)
    assert bool(((kernel - gemlite_exact).abs() <= bound).all())
    assert bool(((gemlite_exact - weight.double()).abs() <= faithful.faithful_bound(converted, weight)).all())


@pytest.mark.parametrize("mutation", ("reversed-nibbles", "fma-zero-read-as-hqq-zero", "scale-of-next-group"))
def test_a_mis_converted_layer_is_caught_against_hqqs_weight(mutation):
    """The mutant zoo's class for converted layouts, at the reference: each plausible
    conversion bug decodes, by the gemlite4 reference, outside the bound of HQQ's weight."""
    pytest.importorskip("hqq")
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    dtype = torch.float16
    linear = torch.nn.Linear(64, 8, bias=False)
    linear.weight.data = torch.randn(8, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    layer = HQQLinear(linear, BaseQuantizeConfig(nbits=4, group_size=32, axis=1), compute_dtype=dtype, device="cpu")
    hqq_parts = hqq_state(layer)
    good = convert_like_gemlite(hqq_parts, dtype)
    if mutation == "reversed-nibbles":
        bad = dataclasses.replace(good, packed=reversed_nibbles(good.packed))
    elif mutation == "fma-zero-read-as-hqq-zero":
        bad = dataclasses.replace(good, group_mode=3)
    else:
        bad = dataclasses.replace(good, scale=np.roll(good.scale, 1, axis=0))
    hqq_exact = hqq4.decode(hqq_parts)
    allowed = bounds.gemlite4_dequantize_bound(good, dtype) + bounds.rounding_bound(hqq_exact, dtype)
    assert bool(((gemlite4.decode(good) - hqq_exact).abs() <= allowed).all())
    assert bool(((gemlite4.decode(bad) - hqq_exact).abs() > allowed).any())

"""gemlite's conversion of an HQQ layer, written out for the CPU (gemlite itself needs a GPU).

``A16Wn.from_hqqlinear`` takes HQQ's unpacked codes, scale and zero and calls
``GemLiteLinearTriton.pack``: the codes as int32 words (``pack_weights_over_cols``, 32-bit
packing, ``transpose=True``), scale and zero as ``(K / group_size, N)`` in the layer's
dtype, and with more than one group per row (mode 4, ``fma_mode``) the zero replaced by
``fl(-zero * scale)``. The reference test pins the layout with these helpers, and the zoo's
CPU gemlite backend (``torch_gemlite4``) stores its weight through them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from pytest_qconform.reference import hqq4
from pytest_qconform.reference.packed import PackedGemlite4, PackedHqq4


def pack_like_gemlite(codes: np.ndarray) -> np.ndarray:
    """``(N, K)`` codes -> ``(K / 8, N)`` int32 words, gemlite's ``pack_weights_over_cols``
    with 32-bit packing and ``transpose=True``, written out from its loop."""
    n, k = codes.shape
    words = np.zeros((n, k // 8), dtype=np.uint32)
    for j in range(k):
        words[:, j // 8] |= codes[:, j].astype(np.uint32) << np.uint32(4 * (j % 8))
    return words.view(np.int32).T.copy()


def reversed_nibbles(words: np.ndarray) -> np.ndarray:
    """A converter that writes code ``j`` into bits ``28 - 4 j`` (the other nibble order)."""
    unsigned = words.view(np.uint32)
    out = np.zeros_like(unsigned)
    for j in range(8):
        out |= ((unsigned >> np.uint32(4 * j)) & np.uint32(15)) << np.uint32(28 - 4 * j)
    return out.view(np.int32)


def hqq_state(layer: Any) -> PackedHqq4:
    """An axis-1 ``HQQLinear``'s codes, scale and zero (bf16 widened to fp32 exactly)."""
    meta = layer.meta
    return PackedHqq4(
        tuple(int(n) for n in meta["shape"]),
        int(meta["group_size"]),
        int(meta["axis"]),
        layer.W_q.cpu().numpy(),
        meta["scale"].float().cpu().numpy(),
        meta["zero"].float().cpu().numpy(),
        meta={"compute_dtype": str(layer.compute_dtype).removeprefix("torch.")},
    )


def convert_like_gemlite(
    p: PackedHqq4, dtype: torch.dtype, pack: Callable[[np.ndarray], np.ndarray] = pack_like_gemlite
) -> PackedGemlite4:
    """An HQQ axis-1 state converted as ``from_hqqlinear`` + ``pack`` (``fma_mode``) do it:
    mode 4 with ``zero_fma`` rounded from float32 to ``dtype``, or mode 3 with HQQ's zero
    where a row is one group. ``pack`` writes the words (a mutant's may write them wrong)."""
    out_features, in_features = p.shape
    codes = hqq4.unpack_4bit_u8(p.packed).reshape(out_features, in_features)
    scale = torch.as_tensor(p.scale).to(dtype).reshape(out_features, -1)
    zero = torch.as_tensor(p.zero).to(dtype).reshape(out_features, -1)
    group_mode = 3 if p.group_size == in_features else 4
    if group_mode == 4:
        zero = (-zero.float() * scale.float()).to(dtype)
    return PackedGemlite4(
        (out_features, in_features),
        p.group_size,
        pack(codes),
        scale.t().float().numpy(),
        zero.t().float().numpy(),
        group_mode=group_mode,
        meta={key: str(dtype).removeprefix("torch.") for key in ("compute_dtype", "scale_dtype", "zero_dtype")},
    )

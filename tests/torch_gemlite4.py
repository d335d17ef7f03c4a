"""A CPU stand-in for ``hqq-gemlite``: HQQ's layer converted to gemlite's layout, computed
in plain PyTorch.

gemlite runs only on a GPU, so the suites' gemlite checks (the reference decoding the
converted int32 words, the stored state against the input, the matmul against the
reference) never run on a CPU against the real backend. This backend stores its weight as
gemlite's conversion does (HQQ quantizes, ``gemlite_packing`` converts), hands that state
over as ``PackedGemlite4`` and multiplies from it: the correct base of the zoo's
conversion mutants (``zoo.py``). Its methods are the steps a mutant changes: ``pack`` (the
words), ``convert`` (the stored scale and zero) and ``dequantize_weight`` (the kernel's
decode).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gemlite_packing import convert_like_gemlite, hqq_state, pack_like_gemlite
from pytest_qconform.reference.packed import PackedGemlite4

from pytest_qconform.backends.adapter_helpers import dtype_name
from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec
from pytest_qconform.backends.hqq import HqqBackend
from pytest_qconform.backends.hqq_gemlite import HqqGemliteBackend

GROUP_SIZES: tuple[int, ...] = (64, 128)  # one of them the whole row of a (64, 128) weight: mode 3 too
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)


class TorchGemlite4Backend(Backend):
    """HQQ 4-bit, axis 1, converted as ``A16Wn.from_hqqlinear`` does; CPU, bf16 and fp32."""

    name = "torch-gemlite4"
    # The lm_head check's weight is 64 features wide, narrower than group 128, which gemlite
    # cannot convert: no lm_head width is claimed (``zoo.narrowed`` reads this).
    zoo_max_out_features = 0

    def availability(self) -> Availability:
        return HqqBackend().availability()  # HQQ quantizes; the rest is this module's

    def capabilities(self, device: torch.device) -> Capabilities:
        """hqq-gemlite's claims (axis 1, no dequantize, backward or serialization), on the
        CPU, at the zoo's group sizes and dtypes, without its GPU routes and paths."""
        return dataclasses.replace(
            HqqGemliteBackend().capabilities(device),
            blocksizes=GROUP_SIZES,
            dtypes=DTYPES,
            devices=("cpu",),
            dispatch_rows=(),
            compiled=(),
            captured=(),
            max_out_features=self.zoo_max_out_features,
        )

    # -- the conversion ----------------------------------------------------------------------
    def pack(self, codes: np.ndarray) -> np.ndarray:
        return pack_like_gemlite(codes)

    def convert(self, layer: Any, dtype: torch.dtype) -> PackedGemlite4:
        return convert_like_gemlite(hqq_state(layer), dtype, self.pack)

    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        if spec.axis != 1 or weight.dim() != 2 or weight.shape[1] % spec.blocksize or weight.dtype not in DTYPES:
            raise ValueError(
                f"{self.name}.quantize: gemlite converts axis-1 layers whose in_features divide by the group "
                f"size; needs a 2-D {DTYPES} weight, got {tuple(weight.shape)} {weight.dtype}, {spec}"
            )
        layer = HqqBackend().quantize(weight, spec).handle.layer  # HQQLinear, PyTorch backend
        converted = self.convert(layer, weight.dtype)
        handle = {
            "W_q": torch.from_numpy(converted.packed),
            "scales": torch.from_numpy(converted.scale).to(weight.dtype),
            "zeros": torch.from_numpy(converted.zero).to(weight.dtype),
            "W_group_mode": converted.group_mode,
            "group_size": spec.blocksize,
        }
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, handle)

    # -- the kernel ------------------------------------------------------------------------
    def dequantize_weight(self, q: Quantized, compute_dtype: torch.dtype) -> torch.Tensor:
        """The weight as gemlite's kernels decode it, in ``compute_dtype``: the words' code
        ``j`` at bits ``4 j``; mode 3 ``(q - zero) * scale`` (two roundings), mode 4 one
        rounding of ``q * scale + zero`` (the fma; exact in float64 before it)."""
        h = q.handle
        out_features, in_features = q.shape
        shifts = torch.arange(8, dtype=torch.int32) * 4
        codes = (h["W_q"].unsqueeze(-1) >> shifts) & 15  # (K / 8, N, 8)
        codes = codes.permute(1, 0, 2).reshape(out_features, in_features)
        scale, zero = (
            h[key].to(compute_dtype).t().repeat_interleave(h["group_size"], dim=1) for key in ("scales", "zeros")
        )
        if h["W_group_mode"] == 3:
            return (codes.to(compute_dtype) - zero) * scale
        return (codes.double() * scale.double() + zero.double()).to(compute_dtype)

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: gemlite's converted layer has no dequantize (not claimed)")

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        w = self.dequantize_weight(q, compute_dtype)
        y = F.linear(x.to(compute_dtype), w, None if bias is None else bias.to(compute_dtype))
        return y.to(x.dtype)

    def export_packed(self, q: Quantized) -> PackedGemlite4:
        h = q.handle
        return PackedGemlite4(
            shape=q.shape,
            group_size=h["group_size"],
            packed=h["W_q"].numpy(),
            scale=h["scales"].float().numpy(),
            zero=h["zeros"].float().numpy(),
            group_mode=h["W_group_mode"],
            meta={key: dtype_name(h["scales"].dtype) for key in ("compute_dtype", "scale_dtype", "zero_dtype")},
        )

"""A plain-PyTorch implementation of bitsandbytes' 4-bit format, behind the adapter contract.

It exists to show what a downstream backend writes (and is the correct base the
project's mutant zoo plants bugs into). Layout: the flattened weight, blockwise absmax,
two codes per byte with the first element in the high nibble; optional double
quantization of absmax with the signed 8-bit dynamic map in blocks of 256 around the
mean absmax. Arithmetic in fp32, as bitsandbytes does.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from pytest_qconform.reference import formats
from pytest_qconform.reference.packed import PackedBnb4

from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec

NESTED_BLOCKSIZE = 256
STORAGES = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)
PATHS = ("dequantize", "matmul", "layer-forward")  # plain PyTorch: right under torch.compile and in CUDA graphs


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest table entry (ties go to the lower index)."""
    return (values.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)


def _blockwise_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    pad = (-flat.numel()) % blocksize
    padded = F.pad(flat, (0, pad)) if pad else flat
    return padded.reshape(-1, blocksize).abs().amax(dim=1)


class TorchNF4Backend(Backend):
    name = "torch-nf4"

    def availability(self) -> Availability:
        return Availability(True, "0.1.0")

    def capabilities(self, device: torch.device) -> Capabilities:
        return Capabilities(
            formats=("nf4", "fp4"),
            blocksizes=(32, 64, 128, 256, 512, 1024, 2048, 4096),
            double_quant=True,
            dtypes=(torch.bfloat16, torch.float16, torch.float32),
            devices=("cpu", "cuda"),
            backward=True,
            serialize=True,
            quant_storages=STORAGES,
            out_arguments=("dequantize", "matmul"),
            explicit_absmax=True,
            compiled=PATHS,
            captured=PATHS,
        )

    # -- quantize -----------------------------------------------------------------------
    def table(self, quant_type: str, device: torch.device) -> torch.Tensor:
        codes = formats.NF4_CODE if quant_type == "nf4" else formats.FP4_CODE
        return torch.tensor(codes, dtype=torch.float32, device=device)

    def quantize_codes(
        self, flat: torch.Tensor, absmax: torch.Tensor, blocksize: int, table: torch.Tensor
    ) -> torch.Tensor:
        scale = absmax.repeat_interleave(blocksize)[: flat.numel()]
        scaled = torch.where(scale > 0, flat / scale, torch.zeros_like(flat))
        return _nearest(scaled, table)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.numel() % 2:
            codes = torch.cat([codes, codes.new_zeros(1)])
        pairs = codes.reshape(-1, 2)
        return (pairs[:, 0] << 4) | pairs[:, 1]

    def nest(self, absmax: torch.Tensor) -> dict:
        offset = absmax.double().mean().float()  # an fp32 sum near fp32's largest overflows to inf
        centered = absmax - offset
        nested_absmax = _blockwise_absmax(centered, NESTED_BLOCKSIZE)
        dyn = torch.tensor(formats.dynamic_map_signed(), dtype=torch.float32, device=absmax.device)
        scale = nested_absmax.repeat_interleave(NESTED_BLOCKSIZE)[: centered.numel()]
        normalized = torch.where(scale > 0, centered / scale, torch.zeros_like(centered))
        return {
            "absmax": _nearest(normalized, dyn),
            "nested_absmax": nested_absmax,
            "nested_code": dyn,
            "offset": float(offset),
        }

    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        if spec.format not in ("nf4", "fp4"):
            raise ValueError(f"{self.name}: format {spec.format!r} is not supported (nf4, fp4)")
        flat = weight.detach().reshape(-1).float()
        absmax = _blockwise_absmax(flat, spec.blocksize)
        table = self.table(spec.format, flat.device)
        packed = self.pack(self.quantize_codes(flat, absmax, spec.blocksize, table))
        handle = {
            "packed": packed.view(spec.quant_storage),  # the same bytes, stored as quant_storage
            "code": table,
            "absmax": absmax,
            "blocksize": spec.blocksize,
            "quant_type": spec.format,
        }
        if spec.double_quant:
            handle.update(self.nest(absmax))
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, handle)

    # -- dequantize / matmul ---------------------------------------------------------------
    def decode_absmax(self, h: dict) -> torch.Tensor:
        if "nested_absmax" not in h:
            return h["absmax"]
        nested = h["nested_absmax"].repeat_interleave(NESTED_BLOCKSIZE)[: h["absmax"].numel()]
        return h["nested_code"][h["absmax"].long()] * nested + h["offset"]

    def unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel]

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_with(q, dtype)

    def dequantize_with(
        self, q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None, absmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """With ``absmax``: fp32 scales given by the caller instead of the stored state."""
        h = q.handle
        numel = math.prod(q.shape)
        codes = self.unpack(h["packed"].view(torch.uint8), numel)
        scales = self.decode_absmax(h) if absmax is None else absmax
        values = (h["code"][codes.long()] * scales.repeat_interleave(h["blocksize"])[:numel]).to(dtype)
        if out is None:
            return values.reshape(q.shape)
        return out.copy_(values.reshape(q.shape))

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        return self.matmul_with(x, q, bias, compute_dtype)

    def matmul_with(
        self,
        x: torch.Tensor,
        q: Quantized,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
        orientation: str = "default",
    ) -> torch.Tensor:
        if orientation != "default":
            return super().matmul_with(x, q, bias, compute_dtype, out=out, orientation=orientation)
        w = self.dequantize(q, compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        y = F.linear(x.to(compute_dtype), w, b)
        return out.copy_(y) if out is not None else y.to(x.dtype)

    # -- packed state, serialization --------------------------------------------------------
    def export_packed(self, q: Quantized) -> PackedBnb4:
        h = q.handle
        np_ = lambda t: t.detach().cpu().numpy()  # noqa: E731
        nested = "nested_absmax" in h
        return PackedBnb4(
            quant_type=h["quant_type"],
            blocksize=h["blocksize"],
            shape=q.shape,
            packed=np_(h["packed"].view(torch.uint8)),
            absmax=np_(h["absmax"]),
            code=np_(h["code"]),
            nested_absmax=np_(h["nested_absmax"]) if nested else None,
            nested_code=np_(h["nested_code"]) if nested else None,
            nested_blocksize=NESTED_BLOCKSIZE if nested else None,
            offset=h["offset"] if nested else None,
        )

    def from_packed(self, packed: PackedBnb4, device: torch.device) -> Quantized:
        t = lambda a: torch.as_tensor(np.asarray(a)).to(device)  # noqa: E731
        handle = {
            "packed": t(packed.packed).reshape(-1),
            "code": t(packed.code).float(),
            "absmax": t(packed.absmax),
            "blocksize": packed.blocksize,
            "quant_type": packed.quant_type,
        }
        if packed.double_quant:
            handle.update(
                {
                    "nested_absmax": t(packed.nested_absmax).float(),
                    "nested_code": t(packed.nested_code).float(),
                    "offset": float(packed.offset),
                }
            )
        spec = QuantSpec(packed.quant_type, packed.blocksize, packed.double_quant)
        return Quantized(self.name, spec, tuple(packed.shape), torch.device(device), handle)

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in q.handle.items() if isinstance(v, torch.Tensor)}
        state["blocksize"] = torch.tensor(q.handle["blocksize"])
        state["shape"] = torch.tensor(q.shape)
        state["quant_type"] = torch.tensor(0 if q.handle["quant_type"] == "nf4" else 1)
        if "offset" in q.handle:
            state["offset"] = torch.tensor(q.handle["offset"])
        return state

    def load(self, state: dict[str, torch.Tensor], device: torch.device) -> Quantized:
        if "blocksize" not in state:
            raise ValueError(f"{self.name}: checkpoint has no blocksize; refusing to guess the platform default")
        self.validate(state)
        handle = {k: v.to(device) for k, v in state.items() if k not in ("blocksize", "shape", "quant_type", "offset")}
        handle["blocksize"] = int(state["blocksize"])
        handle["quant_type"] = "nf4" if int(state["quant_type"]) == 0 else "fp4"
        if "offset" in state:
            handle["offset"] = float(state["offset"])
        shape = tuple(int(n) for n in state["shape"])
        spec = QuantSpec(
            handle["quant_type"], handle["blocksize"], "nested_absmax" in handle, quant_storage=handle["packed"].dtype
        )
        return Quantized(self.name, spec, shape, torch.device(device), handle)

    def validate(self, state: dict[str, torch.Tensor]) -> None:
        """Refuse a state whose tensors are missing or not the sizes its shape and blocksize
        need (a checkpoint cut short, another layer's tensor), naming the tensor."""
        missing = [key for key in ("packed", "code", "absmax", "shape", "quant_type") if key not in state]
        if "nested_absmax" in state:
            missing += [key for key in ("nested_code", "offset") if key not in state]
        if missing:
            raise ValueError(f"{self.name}: checkpoint lacks {missing}")
        shape = tuple(int(n) for n in state["shape"].reshape(-1))
        blocks = -(-math.prod(shape) // int(state["blocksize"]))
        sizes = {
            "packed": (state["packed"].numel() * state["packed"].element_size(), -(-math.prod(shape) // 2), "bytes"),
            "absmax": (state["absmax"].numel(), blocks, "entries"),
            "code": (state["code"].numel(), 16, "entries"),
        }
        if "nested_absmax" in state:
            sizes["nested_absmax"] = (state["nested_absmax"].numel(), -(-blocks // NESTED_BLOCKSIZE), "entries")
        for key, (found, needed, unit) in sizes.items():
            if found != needed:
                raise ValueError(
                    f"{self.name}: checkpoint's {key} has {found} {unit}; a weight of shape {shape} "
                    f"in blocks of {int(state['blocksize'])} needs {needed}"
                )

    # -- layer facet -------------------------------------------------------------------------
    def layers(self):
        """The layer facet: this backend's weight as an ``nn.Module`` (``FunctionalLinear``,
        the plugin's layer for a backend with a functional API only), checked by the layer suites."""
        from pytest_qconform.backends.functional_layer import FunctionalLayers

        return FunctionalLayers(self)

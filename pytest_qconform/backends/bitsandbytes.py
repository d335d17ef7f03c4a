"""bitsandbytes 4-bit (NF4/FP4) through its public API, as users and PEFT call it.

Quantize: ``bitsandbytes.functional.quantize_4bit``. Dequantize: ``dequantize_4bit``.
Matmul: ``bitsandbytes.matmul_4bit`` with the dtype handling of ``Linear4bit.forward``.
Checkpoints: ``Linear4bit.state_dict()`` out, ``Params4bit.from_prequantized`` in (what
transformers does when it loads a pre-quantized model).

Output dtype: bitsandbytes dequantizes to ``quant_state.dtype`` (the weight's dtype at
quantize time), computing ``code * absmax`` in fp32 and rounding once. To get ``dtype``
natively instead of casting the result afterwards (a second rounding when the weight
was fp16 and ``dtype`` bf16), each call hands bitsandbytes a copy of the stored
``QuantState`` whose ``dtype`` field is the requested one; the packed bytes, absmax and
tables are shared, never re-encoded. ``matmul`` does the same with the compute dtype,
which is exactly the state a user gets by loading the model in that dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pytest_qconform.backends._torch_util import dtype_name, import_failure, to_numpy
from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec
from pytest_qconform.reference.packed import PackedBnb4

BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # quantize_4bit's check, 0.50.2
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
FALLBACK_DEFAULT_BLOCKSIZE = 64


@dataclass(frozen=True)
class BnbHandle:
    """What ``quantize_4bit`` returned: the packed uint8 tensor and its ``QuantState``."""

    packed: torch.Tensor
    state: Any  # bitsandbytes.functional.QuantState


def _state_as(state: Any, dtype: torch.dtype) -> Any:
    """A ``QuantState`` sharing every tensor with ``state`` but dequantizing to ``dtype``."""
    from bitsandbytes.functional import QuantState

    return QuantState(absmax=state.absmax, shape=state.shape, code=state.code, blocksize=state.blocksize,
                      quant_type=state.quant_type, dtype=dtype, offset=state.offset, state2=state.state2)


class BitsandbytesBackend(Backend):
    name = "bitsandbytes"

    def availability(self) -> Availability:
        try:
            import bitsandbytes
            import bitsandbytes.functional  # noqa: F401 - the native library loads here
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError (HIP)
            return Availability(False, None, import_failure(self.name, exc))
        return Availability(True, str(getattr(bitsandbytes, "__version__", "unknown")))

    def capabilities(self, device: torch.device) -> Capabilities:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return Capabilities(formats=("nf4", "fp4"), blocksizes=BLOCKSIZES, double_quant=True, dtypes=DTYPES,
                            devices=devices, backward=True, serialize=True)

    def default_blocksize(self) -> int:
        """The blocksize a user gets without asking: what a fresh ``Params4bit`` holds
        (64 on CUDA; some releases use 128 under ROCm). 64 if bitsandbytes cannot say."""
        try:
            from bitsandbytes.nn import Params4bit

            blocksize = Params4bit(torch.empty(0)).blocksize
        except Exception:  # noqa: BLE001 - a missing or broken library falls back to the common default
            return FALLBACK_DEFAULT_BLOCKSIZE
        return int(blocksize) if isinstance(blocksize, int) else FALLBACK_DEFAULT_BLOCKSIZE

    # -- quantize / dequantize / matmul ------------------------------------------------------
    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        import bitsandbytes.functional as bnb_f

        if spec.format not in ("nf4", "fp4"):
            raise ValueError(f"{self.name}: format {spec.format!r} is not a bitsandbytes 4-bit format (nf4, fp4)")
        packed, state = bnb_f.quantize_4bit(weight.detach().contiguous(), blocksize=spec.blocksize,
                                            quant_type=spec.format, compress_statistics=spec.double_quant,
                                            quant_storage=torch.uint8)
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, BnbHandle(packed, state))

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes.functional as bnb_f

        handle: BnbHandle = q.handle
        return bnb_f.dequantize_4bit(handle.packed, _state_as(handle.state, dtype))

    def matmul(self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None,
               compute_dtype: torch.dtype) -> torch.Tensor:
        """``Linear4bit.forward`` with ``compute_dtype`` set: x and bias cast to it, the
        result cast back to x's dtype. The packed weight goes in transposed, as
        ``Linear4bit`` passed it up to 0.49 (0.50 accepts both orientations)."""
        import bitsandbytes

        handle: BnbHandle = q.handle
        inp_dtype = x.dtype
        x = x.to(compute_dtype)
        if bias is not None:
            bias = bias.to(compute_dtype)
        state = _state_as(handle.state, compute_dtype)
        return bitsandbytes.matmul_4bit(x, handle.packed.t(), bias=bias, quant_state=state).to(inp_dtype)

    # -- packed state, serialization -------------------------------------------------------------
    def export_packed(self, q: Quantized) -> PackedBnb4:
        handle: BnbHandle = q.handle
        state = handle.state
        nested = state.state2 if state.nested else None
        return PackedBnb4(
            quant_type=state.quant_type, blocksize=int(state.blocksize), shape=tuple(int(n) for n in state.shape),
            packed=to_numpy(handle.packed).reshape(-1), absmax=to_numpy(state.absmax), code=to_numpy(state.code),
            nested_absmax=to_numpy(nested.absmax) if nested is not None else None,
            nested_code=to_numpy(nested.code) if nested is not None else None,
            nested_blocksize=int(nested.blocksize) if nested is not None else None,
            offset=float(state.offset) if nested is not None else None,
            dtype=dtype_name(state.dtype),
        )

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """``Linear4bit.state_dict()`` of a layer holding this weight (no bias): ``weight``
        plus ``weight.absmax``, ``weight.quant_map``, nested entries and the packed
        ``weight.quant_state.bitsandbytes__<type>`` blob carrying blocksize and shape."""
        from bitsandbytes.nn import Linear4bit, Params4bit

        if len(q.shape) != 2:
            raise ValueError(f"{self.name}: serialize needs a 2-D (out, in) weight for Linear4bit, got shape {q.shape}")
        handle: BnbHandle = q.handle
        out_features, in_features = q.shape
        layer = Linear4bit(in_features, out_features, bias=False, compress_statistics=q.spec.double_quant,
                           quant_type=q.spec.format, quant_storage=torch.uint8, device="meta")
        layer.weight = Params4bit(handle.packed, requires_grad=False, quant_state=handle.state,
                                  blocksize=handle.state.blocksize, compress_statistics=handle.state.nested,
                                  quant_type=handle.state.quant_type, quant_storage=torch.uint8, module=layer,
                                  bnb_quantized=True)
        layer.quant_state = handle.state
        return {key: value.detach().as_subclass(torch.Tensor) for key, value in layer.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor], device: torch.device) -> Quantized:
        """``Params4bit.from_prequantized``, as transformers loads a pre-quantized layer."""
        from bitsandbytes.nn import Params4bit

        if "weight" not in state:
            raise ValueError(f"{self.name}: checkpoint has no 'weight' entry; keys: {sorted(state)}")
        stats = {key.removeprefix("weight."): value for key, value in state.items() if key.startswith("weight.")}
        if not any(key.startswith("quant_state.bitsandbytes__") for key in stats) and "blocksize" not in stats:
            raise ValueError(
                f"{self.name}: checkpoint has no quant_state entry (weight.quant_state.bitsandbytes__nf4/fp4), so "
                "its blocksize, quant_type and shape are unknown; refusing to assume the platform default blocksize. "
                "Save it with Linear4bit.state_dict()."
            )
        param = Params4bit.from_prequantized(data=state["weight"], quantized_stats=stats, requires_grad=False,
                                             device=device)
        qstate = param.quant_state
        spec = QuantSpec(qstate.quant_type, int(qstate.blocksize), bool(qstate.nested))
        packed = param.data.as_subclass(torch.Tensor)
        return Quantized(self.name, spec, tuple(int(n) for n in qstate.shape), torch.device(device),
                         BnbHandle(packed, qstate))

    def layers(self) -> Any:
        """``Linear4bit`` (``bitsandbytes_layer.BitsandbytesLayers``)."""
        from pytest_qconform.backends.bitsandbytes_layer import BitsandbytesLayers

        return BitsandbytesLayers(self)

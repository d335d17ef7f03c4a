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

from typing import Any

import numpy as np
import torch

from pytest_qconform.backends.adapter_helpers import dtype_from_name, dtype_name, import_failure, packed_bytes, to_numpy
from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec
from pytest_qconform.backends.handles import BnbHandle
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

BLOCKSIZES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # quantize_4bit's check, 0.50.2
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
QUANT_STORAGES: tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.bfloat16,
    torch.float16,
    torch.float32,
)  # quantize_4bit's docs
FALLBACK_DEFAULT_BLOCKSIZE = 64
# Under torch.compile and in CUDA graphs: its kernels are torch custom ops (0.50.2:
# torch.ops.bitsandbytes.dequantize_4bit, ...), and vLLM runs them compiled and captured.
PATH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul", "layer-forward")


def _state_as(state: Any, dtype: torch.dtype) -> Any:
    """A ``QuantState`` sharing every tensor with ``state`` but dequantizing to ``dtype``."""
    from bitsandbytes.functional import QuantState

    return QuantState(
        absmax=state.absmax,
        shape=state.shape,
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=dtype,
        offset=state.offset,
        state2=state.state2,
    )


def native_library_failure() -> str | None:
    """Why bitsandbytes' GPU library did not load, or None.

    bitsandbytes (0.45 on, 0.50.2 checked) does not fail its import when the CUDA or ROCm
    library cannot be loaded (no binary for the runtime's version, a missing symbol): it
    logs the error and installs a stand-in (``cextension.ErrorHandlerMockBNBNativeLibrary``)
    that raises on the first native call. Without this check every GPU test would fail on
    that call instead of the backend showing as unavailable with bitsandbytes' reason. On
    the CPU the stand-in is normal (its CPU code needs no library).
    """
    try:
        from bitsandbytes import cextension
    except Exception:  # noqa: BLE001 - an older layout: nothing to inspect, the import itself worked
        return None
    library, backend = getattr(cextension, "lib", None), getattr(cextension, "BNB_BACKEND", "CPU")
    if backend in ("CPU", "XPU") or type(library).__name__ != "ErrorHandlerMockBNBNativeLibrary":
        return None
    lines = str(getattr(library, "error_msg", "") or "no message").strip().splitlines()
    return f"bitsandbytes: its {backend} library did not load: {lines[0] if lines else 'no message'}"


class BitsandbytesBackend(Backend):
    name = "bitsandbytes"

    def availability(self) -> Availability:
        try:
            import bitsandbytes
            import bitsandbytes.functional  # noqa: F401 - the native library loads here
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError (undefined symbol), RuntimeError (HIP)
            return Availability(False, None, import_failure(self.name, exc))
        version = str(getattr(bitsandbytes, "__version__", "unknown"))
        failure = native_library_failure()
        if failure:
            return Availability(False, version, failure)
        return Availability(True, version)

    def capabilities(self, device: torch.device) -> Capabilities:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return Capabilities(
            formats=("nf4", "fp4"),
            blocksizes=BLOCKSIZES,
            double_quant=True,
            dtypes=DTYPES,
            devices=devices,
            backward=True,
            serialize=True,
            quant_storages=QUANT_STORAGES,
            out_arguments=("dequantize", "matmul"),
            explicit_absmax=True,
            weight_orientations=("default", "as-quantized"),
            compiled=PATH_OPERATIONS,
            captured=PATH_OPERATIONS,
            dispatch_rows=(2,),
        )  # matmul_4bit: a gemv for one row, dequantize + GEMM beyond

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
        """``quantize_4bit`` on the weight exactly as passed (any strides: no copy made
        contiguous in front of the library)."""
        import bitsandbytes.functional as bnb_f

        if spec.format not in ("nf4", "fp4"):
            raise ValueError(f"{self.name}: format {spec.format!r} is not a bitsandbytes 4-bit format (nf4, fp4)")
        packed, state = bnb_f.quantize_4bit(
            weight.detach(),
            blocksize=spec.blocksize,
            quant_type=spec.format,
            compress_statistics=spec.double_quant,
            quant_storage=spec.quant_storage,
        )
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, BnbHandle(packed, state))

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_with(q, dtype)

    def dequantize_with(
        self, q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None, absmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``dequantize_4bit(packed, state, out=out)``; with ``absmax``, the stateless form
        ``dequantize_4bit(packed, absmax=absmax, out=out, blocksize=..., quant_type=...)``,
        which takes shape and dtype from ``out`` (bitsandbytes requires it there)."""
        import bitsandbytes.functional as bnb_f

        handle: BnbHandle = q.handle
        if absmax is not None:
            if out is None:
                out = torch.empty(q.shape, dtype=dtype, device=q.device)
            return bnb_f.dequantize_4bit(
                handle.packed,
                absmax=absmax,
                out=out,
                blocksize=handle.state.blocksize,
                quant_type=handle.state.quant_type,
            )
        return bnb_f.dequantize_4bit(handle.packed, _state_as(handle.state, dtype), out=out)

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
        """``Linear4bit.forward`` with ``compute_dtype`` set: x and bias cast to it, the
        result cast back to x's dtype. ``orientation`` "default" hands ``matmul_4bit`` the
        packed weight transposed, as ``Linear4bit`` passed it up to 0.49; "as-quantized"
        hands it over as ``quantize_4bit`` returned it (0.50 accepts both: matmul_4bit
        normalizes B). ``out`` goes to ``matmul_4bit(out=...)``; it must have the compute
        dtype (no cast afterwards)."""
        import bitsandbytes

        if orientation not in ("default", "as-quantized"):
            raise ValueError(f"{self.name}: orientation must be 'default' or 'as-quantized', got {orientation!r}")
        handle: BnbHandle = q.handle
        inp_dtype = x.dtype
        x = x.to(compute_dtype)
        if bias is not None:
            bias = bias.to(compute_dtype)
        state = _state_as(handle.state, compute_dtype)
        weight = handle.packed.t() if orientation == "default" else handle.packed
        y = bitsandbytes.matmul_4bit(x, weight, bias=bias, quant_state=state, out=out)
        return y if out is not None else y.to(inp_dtype)

    # -- packed state, serialization -------------------------------------------------------------
    def export_packed(self, q: Quantized) -> PackedBnb4:
        handle: BnbHandle = q.handle
        state = handle.state
        nested = state.state2 if state.nested else None
        return PackedBnb4(
            quant_type=state.quant_type,
            blocksize=int(state.blocksize),
            shape=tuple(int(n) for n in state.shape),
            packed=packed_bytes(handle.packed),
            absmax=to_numpy(state.absmax),
            code=to_numpy(state.code),
            nested_absmax=to_numpy(nested.absmax) if nested is not None else None,
            nested_code=to_numpy(nested.code) if nested is not None else None,
            nested_blocksize=int(nested.blocksize) if nested is not None else None,
            offset=float(state.offset) if nested is not None else None,
            dtype=dtype_name(state.dtype),
        )

    def from_packed(self, packed: PackedBnb4 | PackedHqq4, device: torch.device) -> Quantized:
        """A ``QuantState`` around bytes produced elsewhere (bitsandbytes' own layout), as a
        loader holding the raw tensors would build it; uint8 storage."""
        from bitsandbytes.functional import QuantState

        if not isinstance(packed, PackedBnb4):
            raise NotImplementedError(f"{self.name} reads its own 4-bit layout only, not {type(packed).__name__}")

        def tensor(array: np.ndarray, dtype: type) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(array, dtype=dtype)).reshape(-1).to(device)

        state2, offset = None, None
        if packed.double_quant:
            state2 = QuantState(
                absmax=tensor(packed.nested_absmax, np.float32),
                code=tensor(packed.nested_code, np.float32),
                blocksize=int(packed.nested_blocksize or 256),
                dtype=torch.float32,
            )
            offset = torch.tensor(float(packed.offset or 0.0), dtype=torch.float32, device=device)
        absmax = tensor(packed.absmax, np.uint8 if packed.double_quant else np.float32)
        state = QuantState(
            absmax=absmax,
            shape=torch.Size(packed.shape),
            code=tensor(packed.code, np.float32),
            blocksize=int(packed.blocksize),
            quant_type=packed.quant_type,
            dtype=dtype_from_name(packed.dtype),
            offset=offset,
            state2=state2,
        )
        spec = QuantSpec(packed.quant_type, int(packed.blocksize), packed.double_quant)
        handle = BnbHandle(tensor(packed.packed, np.uint8).reshape(-1, 1), state)
        return Quantized(self.name, spec, tuple(int(n) for n in packed.shape), torch.device(device), handle)

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """``Linear4bit.state_dict()`` of a layer holding this weight (no bias): ``weight``
        plus ``weight.absmax``, ``weight.quant_map``, nested entries and the packed
        ``weight.quant_state.bitsandbytes__<type>`` blob carrying blocksize and shape."""
        from bitsandbytes.nn import Linear4bit, Params4bit

        if len(q.shape) != 2:
            raise ValueError(f"{self.name}: serialize needs a 2-D (out, in) weight for Linear4bit, got shape {q.shape}")
        handle: BnbHandle = q.handle
        out_features, in_features = q.shape
        storage = handle.packed.dtype
        layer = Linear4bit(
            in_features,
            out_features,
            bias=False,
            compress_statistics=q.spec.double_quant,
            quant_type=q.spec.format,
            quant_storage=storage,
            device="meta",
        )
        layer.weight = Params4bit(
            handle.packed,
            requires_grad=False,
            quant_state=handle.state,
            blocksize=handle.state.blocksize,
            compress_statistics=handle.state.nested,
            quant_type=handle.state.quant_type,
            quant_storage=storage,
            module=layer,
            bnb_quantized=True,
        )
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
        param = Params4bit.from_prequantized(
            data=state["weight"], quantized_stats=stats, requires_grad=False, device=device
        )
        qstate = param.quant_state
        packed = param.data.as_subclass(torch.Tensor)
        spec = QuantSpec(qstate.quant_type, int(qstate.blocksize), bool(qstate.nested), quant_storage=packed.dtype)
        return Quantized(
            self.name, spec, tuple(int(n) for n in qstate.shape), torch.device(device), BnbHandle(packed, qstate)
        )

    def layers(self) -> Any:
        """``Linear4bit`` (``bitsandbytes_layer.BitsandbytesLayers``)."""
        from pytest_qconform.backends.bitsandbytes_layer import BitsandbytesLayers

        return BitsandbytesLayers(self)

"""Our Triton NF4/FP4 kernels (``qconform_triton_nf4.kernels``) behind the adapter contract.

The kernels read bitsandbytes' packed layout, so this backend stores exactly that:
the flattened weight two codes per byte (even element in the high nibble), fp32 absmax
per block, optionally double-quantized (uint8 codes into the signed 8-bit dynamic map,
blocks of 256, plus the mean offset). Quantization is our kernel's too
(``kernels.nf4_quantize``, on the weight's device): the suites check its codes against the
reference quantizer, which this module never calls. Double quantization of the fp32 absmax
(one value per block: a 64th of the weight at the default blocksize) is
``double_quant.nest_absmax``, plain PyTorch on the same device.
``from_packed`` adopts bytes bitsandbytes produced, which is the interop the suites check.

Matmul: on sm_90, from ``kernels.ws_min_rows`` (17) to ``kernels.ws_max_rows`` rows (128,
and 256 for weights of 32 Mi elements and more; measured), the warp-specialized Gluon GEMM
(``kernels.ws_gemm_4bit``) where it reads x in place. Otherwise as many rows as
``kernels.fused_rows_limit`` says the fused ``gemv_4bit`` serves faster go through it; more
rows, up to ``kernels.tc_max_rows`` (64 on sm_90; 0, off, elsewhere) through the fused
tensor-core GEMM (``kernels.tc_gemm_4bit``); the rest dequantize into the adapter's
``WeightBuffer`` in the compute dtype and call ``torch.matmul``. The backward (``dx = dy
W``) dequantizes again rather than keeping the buffer's view, which the next call
overwrites. On CPU the kernels run in Triton's interpreter, which needs
``TRITON_INTERPRET=1`` in the environment before the kernels are first imported.

Under ``torch.compile`` the same kernels are reached through custom operators
(``triton_nf4_ops``: dynamo cannot trace a kernel launcher, least of all the interpreter);
eager calls and CUDA-graph capture call them directly.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from numpy.typing import DTypeLike
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

from pytest_qconform.backends.adapter_helpers import import_failure, to_numpy
from pytest_qconform.backends.base import (
    Availability,
    Backend,
    Capabilities,
    Quantized,
    QuantSpec,
)
from qconform_triton_nf4 import ops as triton_nf4_ops
from qconform_triton_nf4 import plans as triton_nf4_plans
from qconform_triton_nf4.double_quant import NESTED_BLOCKSIZE, code_table, nest_absmax

PATH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul", "layer-forward")  # claimed compiled and captured
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
STATE_FORMAT_VERSION = 1  # of serialize()'s dict
_QUANT_TYPES = ("nf4", "fp4")


_CURRENT_DEVICE = contextlib.nullcontext()  # stateless: one shared instance


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches a kernel on the current device, whatever device its tensors are on
    (triton#2441: "Pointer argument cannot be accessed from Triton" with the tensors on
    cuda:1 while cuda:0 is current, the state of every layer past the first GPU under
    ``device_map="auto"``). ``torch.cuda.device`` of the tensor's GPU around the launches when
    that is not the current one; else a shared no-op, so the common call pays one read of
    the current device (``torch.cuda.current_device()``; its host cost is to be measured on a
    GPU, bench/notes.md "Host cost per call")."""
    device = tensor.device
    if device.type != "cuda" or device.index is None or torch.compiler.is_compiling():
        return _CURRENT_DEVICE  # (a compiled graph calls the kernels through ops.py's operators)
    return _CURRENT_DEVICE if device.index == torch.cuda.current_device() else torch.cuda.device(device)


# Rows routed to the fused gemv at most (kernels.fused_rows_limit may say fewer for a given
# x and device). Measured on the H100 (bench/notes.md "v15"): at 8192 x 8192 bf16 the
# per-row kernel serves 1 row (22.4 us), the tensor-core kernel 2-32 (34.2-84.1 us);
# dequantize + cuBLAS takes 115.6 us at any of these batches and wins from 33 on (at
# 4096^2 it is level at 32 rows: 29.0 against 30.5).
# The matmul suite checks every batch up to one past this
# (test_matmul_every_row_count_past_the_fused_limit), 2 rows on against the
# dequantize-then-GEMM error model, which both fused routes meet: the per-row kernels keep
# code * absmax in fp32, the tensor-core kernel rounds it once to the compute dtype.
FUSED_MAX_ROWS = 32
INTERPRETED_BLOCKSIZES: tuple[int, ...] = (64, 128)  # claimed on the CPU (Triton's interpreter)
INTERPRETED_MAX_OUT_FEATURES = 4096


@dataclass(frozen=True)
class Nf4State:
    """bitsandbytes-layout state on one device, as the kernels take it."""

    quant_type: str
    blocksize: int
    shape: tuple[int, ...]
    packed: torch.Tensor  # uint8, ceil(numel / 2)
    absmax: torch.Tensor  # float32 per block, or uint8 codes when double quantized
    code: torch.Tensor  # float32[16]
    nested_absmax: torch.Tensor | None = None
    nested_code: torch.Tensor | None = None
    nested_blocksize: int = NESTED_BLOCKSIZE
    offset: float | None = None
    # Eager-call plans by activation layout (triton_nf4_plans): filled by the adapter.
    plans: dict[Any, Any] = field(init=False, default_factory=dict, compare=False, repr=False)
    # Their native launches (kernels.native_launch) by the same keys, None where a plan has
    # none; ``fast[0]``: the one of the layout called last, tried before any key is built.
    natives: dict[Any, Any] = field(init=False, default_factory=dict, compare=False, repr=False)
    fast: list[Any] = field(init=False, default_factory=lambda: [None], compare=False, repr=False)

    def __post_init__(self) -> None:
        """The state's tensors are static addresses to a compiled graph, as a module's
        parameters and buffers are: ``torch.compile(mode="reduce-overhead")`` would otherwise
        copy every weight into the CUDA graph's own input buffers before each replay (~130 MB
        a step for the two-layer decode model of bench/decode_step.py). This is what
        ``torch._dynamo.mark_static_address(t, guard=False)`` does, without importing dynamo
        into every eager run; the state never replaces a tensor."""
        for name in ("packed", "absmax", "code", "nested_absmax", "nested_code"):
            tensor = getattr(self, name)
            if isinstance(tensor, torch.Tensor):
                tensor._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> Nf4State:
        """A copy of the tensors with no plans: a plan binds the tensors it was made for."""
        return Nf4State(**{f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self) if f.init})

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    def kernel_args(self) -> dict[str, Any]:
        """Keyword arguments every kernel entry point takes."""
        return {
            "blocksize": self.blocksize,
            "shape": self.shape,
            "code": self.code,
            "nested_absmax": self.nested_absmax,
            "nested_code": self.nested_code,
            "nested_blocksize": self.nested_blocksize,
            "offset": self.offset,
        }


class _Nf4Linear(torch.autograd.Function):
    """``y = x W^T + b`` through the kernels; gradients for x and bias (W is frozen)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, backend: TritonNf4Backend, state: Nf4State
    ) -> torch.Tensor:
        ctx.backend, ctx.state, ctx.has_bias = backend, state, bias is not None
        return backend.linear(x, state, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        state: Nf4State = ctx.state
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            with on_device_of(dy):
                weight = ctx.backend.buffered_weight(state, dy.dtype)
            dx = torch.matmul(dy, weight)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dbias, None, None


def _rejected_target(triton_version: str) -> str | None:
    """Why this Triton cannot compile for the GPU at hand (unsupported_targets.toml), or None."""
    from pytest_qconform.hardware.archs import normalize_gcn_arch
    from qconform_triton_nf4.unsupported_targets import rejection

    if not torch.version.hip:
        return None
    arch = normalize_gcn_arch(getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") or "")
    entry = rejection(arch, triton_version)
    return f"triton {triton_version} cannot compile for {arch}: {entry.reason}" if entry else None


class TritonNf4Backend(Backend):
    name = "triton-nf4"

    def __init__(self) -> None:
        self._buffer: Any = None  # kernels.WeightBuffer, built on first use (the import is lazy)
        # (format, device) -> (code table, nf4_quantize.CodeBoundaries), made once: building
        # them per call would copy host lists to the device at every quantize.
        self._tables: dict[tuple[str, str], tuple[torch.Tensor, Any]] = {}

    def code_boundaries(self, quant_type: str, device: torch.device) -> Any:
        """The quantize kernel's view of ``quant_type``'s table on ``device``."""
        return self._table(quant_type, device)[1]

    def _table(self, quant_type: str, device: torch.device) -> tuple[torch.Tensor, Any]:
        from qconform_triton_nf4.kernels.nf4_quantize import code_boundaries

        key = (quant_type, str(device))
        if key not in self._tables:
            code = code_table(quant_type, device)
            self._tables[key] = (code, code_boundaries(code).to(device))
        return self._tables[key]

    def availability(self) -> Availability:
        try:
            import triton
        except Exception as exc:  # noqa: BLE001 - reported, never raised
            return Availability(False, None, import_failure("triton", exc))
        version = str(getattr(triton, "__version__", "unknown"))
        try:
            from qconform_triton_nf4 import kernels
        except Exception as exc:  # noqa: BLE001
            return Availability(False, version, import_failure(f"{self.name} kernels", exc))
        if torch.cuda.is_available():
            rejected = _rejected_target(version)
            if rejected:
                return Availability(False, version, rejected)
            return Availability(True, version)
        if kernels.interpreter_active():
            from qconform_triton_nf4.mode import stdlib_problem

            problem = stdlib_problem()  # triton imported before the interpreter was asked for
            return Availability(False, version, f"{self.name}: {problem}") if problem else Availability(True, version)
        return Availability(
            False,
            version,
            (
                f"{self.name}: no GPU, and the kernels were not built for Triton's interpreter: set TRITON_INTERPRET=1 "
                "in the environment before triton and qconform_triton_nf4.kernels are first imported (pytest-qconform "
                "sets it itself on GPU-less machines when it configures before anything imports triton)"
            ),
        )

    def capabilities(self, device: torch.device) -> Capabilities:
        from qconform_triton_nf4 import kernels

        devices = (("cuda",) if torch.cuda.is_available() else ()) + (("cpu",) if kernels.interpreter_active() else ())
        # On the CPU the kernels run in Triton's interpreter, a testing aid some hundred times
        # slower than compiled code: there the backend claims the CUDA and ROCm default
        # blocksizes only, so that a CPU run of every check stays short (the project's
        # tests/test_kernels.py runs the kernels at 32 to 256 in the interpreter; a GPU run, at all).
        # Its run time grows with the weight too (40 to 120 s for one lm_head-wide matmul), so
        # there it claims no weight wider than INTERPRETED_MAX_OUT_FEATURES.
        blocksizes = tuple(kernels.SUPPORTED_BLOCKSIZES) if device.type != "cpu" else INTERPRETED_BLOCKSIZES
        max_out = None if device.type != "cpu" else INTERPRETED_MAX_OUT_FEATURES
        # The interpreter routes fewer rows to the tensor-core kernel (nf4_gemv.mma_rows).
        mma_low, mma_high = kernels.nf4_gemv.mma_rows()
        fused_max = min(FUSED_MAX_ROWS, mma_high)
        # Past the fused rows, the warp-specialized GEMM (Hopper) and the tensor-core GEMM up to
        # their arch class's thresholds (0: off).
        tc_high = kernels.tc_max_rows(device)
        ws_low = kernels.ws_min_rows(device)
        ws_high = kernels.ws_max_rows(device)  # any weight's; a large weight's more rows are its own route's
        return Capabilities(
            formats=_QUANT_TYPES,
            blocksizes=blocksizes,
            double_quant=True,
            max_out_features=max_out,
            dtypes=DTYPES,
            devices=devices,
            backward=True,
            serialize=True,
            max_gemv_rows=fused_max,
            out_arguments=("dequantize",),
            compiled=PATH_OPERATIONS,
            captured=PATH_OPERATIONS,
            dispatch_rows=(
                mma_low,  # per-row kernels -> tensor cores
                kernels.nf4_gemv.PER_ROW_MAX_ROWS + 1,  # no tensor cores: -> GEMM
                fused_max + 1,  # -> tensor-core GEMM (where on), else dequantize + GEMM
                *((tc_high + 1,) if tc_high > fused_max else ()),  # tensor-core GEMM -> dequantize + GEMM
                # fused kernels -> warp-specialized GEMM (Hopper) -> tensor-core GEMM or dequantize + GEMM
                *((ws_low,) if ws_high and ws_low else ()),
                *((ws_high + 1,) if ws_high > max(fused_max, tc_high) else ()),
            ),
        )

    # -- quantize / dequantize / matmul ------------------------------------------------------
    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        if spec.format not in _QUANT_TYPES:
            raise ValueError(f"{self.name}: format {spec.format!r} is not supported; the kernels read nf4 and fp4")
        from qconform_triton_nf4 import kernels

        with on_device_of(weight):
            packed, absmax = kernels.quantize_4bit(
                weight, blocksize=spec.blocksize, boundaries=self.code_boundaries(spec.format, weight.device)
            )
        code = self._table(spec.format, weight.device)[0].clone()  # each state owns its table
        nested: dict[str, Any] = {}
        if spec.double_quant:
            codes, nested_absmax, nested_code, offset = nest_absmax(absmax)
            absmax = codes
            nested = {"nested_absmax": nested_absmax, "nested_code": nested_code, "offset": offset}
        state = Nf4State(spec.format, spec.blocksize, tuple(weight.shape), packed, absmax, code, **nested)
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, state)

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_with(q, dtype)

    def dequantize_with(
        self, q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None, absmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``kernels.dequantize_4bit(..., out=out)``; the kernels take no explicit absmax form."""
        if absmax is not None:
            return super().dequantize_with(q, dtype, out=out, absmax=absmax)
        state: Nf4State = q.handle
        with on_device_of(state.packed):
            return self._dequantize(state, dtype, out)

    def _dequantize(self, state: Nf4State, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
        from qconform_triton_nf4 import kernels

        if torch.compiler.is_compiling():
            result = triton_nf4_ops.dequantize(state, dtype)
            return result if out is None else out.copy_(result)
        if out is not None:  # the caller's tensor: checked on every call
            return kernels.dequantize_4bit(state.packed, state.absmax, out_dtype=dtype, out=out, **state.kernel_args())
        return self._dequantize_plan(state, dtype)(torch.empty(state.shape, dtype=dtype, device=state.packed.device))

    @staticmethod
    def _dequantize_plan(state: Nf4State, dtype: torch.dtype) -> Any:
        """``state``'s dequantize plan for ``dtype``, validated and built on first use."""
        key = ("dequantize", dtype)
        plan = state.plans.get(key)
        if plan is None:
            from qconform_triton_nf4 import kernels

            plan = kernels.dequantize_4bit_plan(state.packed, state.absmax, out_dtype=dtype, **state.kernel_args())
            state.plans[key] = plan
        return plan

    def buffered_weight(self, state: Nf4State, dtype: torch.dtype) -> torch.Tensor:
        """The weight dequantized into this backend's reusable buffer; valid until the next call.
        (Under torch.compile a fresh tensor: the compiled graph owns its memory.)"""
        if torch.compiler.is_compiling():
            return triton_nf4_ops.dequantize(state, dtype)
        plan = self._dequantize_plan(state, dtype)
        if self._buffer is None:
            from qconform_triton_nf4 import kernels

            self._buffer = kernels.WeightBuffer()
        return plan(self._buffer.view(state.shape, dtype, state.packed.device))

    def linear(self, x: torch.Tensor, state: Nf4State, bias: torch.Tensor | None) -> torch.Tensor:
        """Forward only: the plan for x's and bias' layout (``triton_nf4_plans``), built and
        validated on the first call of that layout: fused gemv for few rows, else buffer
        dequantize + ``torch.matmul``."""
        if torch.compiler.is_compiling():
            self._check_2d(state)
            return triton_nf4_ops.linear(x, state, bias, FUSED_MAX_ROWS)
        fast = state.fast[0]
        if fast is not None and (y := fast(x, bias)) is not None:
            return y
        key = triton_nf4_plans.plan_key(x, bias)
        plan = state.plans.get(key)
        if plan is None:
            self._check_2d(state)
            plan = triton_nf4_plans.linear_plan(
                x,
                state.packed,
                state.absmax,
                state.kernel_args(),
                bias,
                FUSED_MAX_ROWS,
                lambda dtype: self.buffered_weight(state, dtype),
            )
            state.plans[key] = plan
            y = plan(x, bias)  # the first call binds the launches a native launch is made from
            state.natives[key] = state.fast[0] = triton_nf4_plans.native_launch(plan, x, bias)
            return y
        native = state.natives.get(key)
        if native is not None:
            state.fast[0] = native
            if (y := native(x, bias)) is not None:
                return y
        return plan(x, bias)

    def _check_2d(self, state: Nf4State) -> None:
        if len(state.shape) != 2:
            raise ValueError(f"{self.name}: matmul needs a 2-D (out, in) weight, got shape {state.shape}")

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        """x and bias cast to ``compute_dtype``; the result cast back to x's dtype."""
        if x.dtype is compute_dtype and not torch.compiler.is_compiling():
            fast = q.handle.fast[0]  # the native launch of the last layout: it checks x and bias itself
            if fast is not None and (y := fast(x, bias)) is not None:
                return y
        inp_dtype = x.dtype
        if inp_dtype != compute_dtype:  # a no-op .to() still costs host time per call
            x = x.to(compute_dtype)
        if bias is not None and bias.dtype != compute_dtype:
            bias = bias.to(compute_dtype)
        with on_device_of(x):
            if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
                y = _Nf4Linear.apply(x, bias, self, q.handle)
            else:
                y = self.linear(x, q.handle, bias)  # no graph to record: no autograd.Function
        return y if y.dtype == inp_dtype else y.to(inp_dtype)

    # -- packed state, serialization -------------------------------------------------------------
    def export_packed(self, q: Quantized) -> PackedBnb4:
        state: Nf4State = q.handle
        nested = state.double_quant
        return PackedBnb4(
            quant_type=state.quant_type,
            blocksize=state.blocksize,
            shape=state.shape,
            packed=to_numpy(state.packed).reshape(-1),
            absmax=to_numpy(state.absmax),
            code=to_numpy(state.code),
            nested_absmax=to_numpy(state.nested_absmax) if state.nested_absmax is not None else None,
            nested_code=to_numpy(state.nested_code) if state.nested_code is not None else None,
            nested_blocksize=state.nested_blocksize if nested else None,
            offset=state.offset if nested else None,
        )

    def from_packed(self, packed: PackedBnb4 | PackedHqq4, device: torch.device) -> Quantized:
        if not isinstance(packed, PackedBnb4):
            raise NotImplementedError(f"{self.name} reads bitsandbytes' layout only, not {type(packed).__name__}")

        def tensor(array: np.ndarray, dtype: DTypeLike) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(array, dtype=dtype)).reshape(-1).to(device)

        nested: dict[str, Any] = {}
        if packed.double_quant:
            nested = {
                "nested_absmax": tensor(packed.nested_absmax, np.float32),
                "nested_code": tensor(packed.nested_code, np.float32),
                "nested_blocksize": int(packed.nested_blocksize or NESTED_BLOCKSIZE),
                "offset": float(packed.offset or 0.0),
            }
        absmax = tensor(packed.absmax, np.uint8 if packed.double_quant else np.float32)
        state = Nf4State(
            packed.quant_type,
            int(packed.blocksize),
            tuple(int(n) for n in packed.shape),
            tensor(packed.packed, np.uint8),
            absmax,
            tensor(packed.code, np.float32),
            **nested,
        )
        spec = QuantSpec(packed.quant_type, int(packed.blocksize), packed.double_quant)
        return Quantized(self.name, spec, state.shape, torch.device(device), state)

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """Every tensor of the state plus its scalars as 0-d/1-d tensors (safetensors-ready)."""
        state: Nf4State = q.handle
        out = {
            "format_version": torch.tensor(STATE_FORMAT_VERSION),
            "packed": state.packed,
            "absmax": state.absmax,
            "code": state.code,
            "blocksize": torch.tensor(state.blocksize),
            "shape": torch.tensor(state.shape),
            "quant_type": torch.tensor(_QUANT_TYPES.index(state.quant_type)),
        }
        if state.nested_absmax is not None and state.nested_code is not None:
            out.update(
                {
                    "nested_absmax": state.nested_absmax,
                    "nested_code": state.nested_code,
                    "nested_blocksize": torch.tensor(state.nested_blocksize),
                    "offset": torch.tensor(state.offset, dtype=torch.float64),
                }
            )
        return out

    def load(self, state: dict[str, torch.Tensor], device: torch.device) -> Quantized:
        where = f"{self.name}.load"
        missing = [
            k
            for k in ("format_version", "packed", "absmax", "code", "blocksize", "shape", "quant_type")
            if k not in state
        ]
        if missing:
            raise ValueError(
                f"{where}: checkpoint lacks {missing}; without its blocksize it cannot be decoded "
                "safely (the platform default may differ). Save it with serialize()."
            )
        version = int(state["format_version"])
        if version != STATE_FORMAT_VERSION:
            raise ValueError(f"{where}: checkpoint format_version {version}, this version reads {STATE_FORMAT_VERSION}")
        nested: dict[str, Any] = {}
        if "nested_absmax" in state:
            nested = {
                "nested_absmax": state["nested_absmax"].to(device),
                "nested_code": state["nested_code"].to(device),
                "nested_blocksize": int(state["nested_blocksize"]),
                "offset": float(state["offset"]),
            }
        quant_type = _QUANT_TYPES[int(state["quant_type"])]
        blocksize = int(state["blocksize"])
        shape = tuple(int(n) for n in state["shape"].reshape(-1).tolist())
        numel = 1
        for n in shape:
            numel *= n
        blocks = -(-numel // blocksize)
        sizes = {  # a checkpoint cut short, or another layer's tensor, is refused here, not at a kernel
            "packed": (state["packed"].numel() * state["packed"].element_size(), -(-numel // 2)),
            "absmax": (state["absmax"].numel(), blocks),
            "code": (state["code"].numel(), 16),
        }
        if nested:
            sizes["nested_absmax"] = (nested["nested_absmax"].numel(), -(-blocks // nested["nested_blocksize"]))
        for key, (found, needed) in sizes.items():
            if found != needed:
                raise ValueError(
                    f"{where}: checkpoint's {key} has {found} entries (bytes, for packed); a weight of shape "
                    f"{shape} in blocks of {blocksize} needs {needed}"
                )
        loaded = Nf4State(
            quant_type,
            blocksize,
            shape,
            state["packed"].to(device),
            state["absmax"].to(device),
            state["code"].to(device),
            **nested,
        )
        spec = QuantSpec(quant_type, blocksize, loaded.double_quant)
        return Quantized(self.name, spec, shape, torch.device(device), loaded)

    def layers(self) -> Any:
        """Our layer: ``functional_layer.FunctionalLinear`` on this adapter (kernels and its
        one ``WeightBuffer``, shared by every layer built from it)."""
        from pytest_qconform.backends.functional_layer import FunctionalLayers

        return FunctionalLayers(self)

"""The mutant zoo: deliberately broken backends, each with one planted bug of a known class.

Every mutant is the correct plain-PyTorch backend of ``examples/downstream`` (or, for
gemlite's conversion of HQQ layers, the CPU stand-in ``torch_gemlite4``) with one method
changed, and names the operation (matrix cell) whose check must catch it. The zoo test
runs the real suites against all of them and requires each to fail exactly where it
should, while the unmodified backends pass everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import weakref

import numpy as np
import torch
import torch.nn.functional as F
from gemlite_packing import reversed_nibbles
from qconform_example_nf4.backend import TorchNF4Backend
from torch_gemlite4 import TorchGemlite4Backend

from pytest_qconform.backends.base import Backend, Quantized
from pytest_qconform.backends.functional_layer import PREFIX, FunctionalLayers, FunctionalLinear
from qconform_triton_nf4.backend import TritonNf4Backend
from qconform_triton_nf4.double_quant import code_table


class KeepsFirstDtypeBuffer(TorchNF4Backend):
    """unsloth PR 4026: a reused dequantize buffer that keeps the dtype of its first use."""

    name = "mutant-stale-buffer"
    catches = "sequencing"

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        fresh = super().dequantize(q, dtype)
        if self.buffer is None or self.buffer.shape != fresh.shape:
            self.buffer = torch.empty_like(fresh)
        self.buffer.copy_(fresh)
        return self.buffer


class SwappedNibbles(TorchNF4Backend):
    """Reads the low nibble as the first element."""

    name = "mutant-swapped-nibbles"
    catches = "dequantize"

    def unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]


class WrongBlockAbsmax(TorchNF4Backend):
    """Scales the final block by its neighbour's absmax (an off-by-one in the block index)."""

    name = "mutant-wrong-block-absmax"
    catches = "dequantize"

    def decode_absmax(self, h: dict) -> torch.Tensor:
        absmax = super().decode_absmax(h).clone()
        if absmax.numel() > 1:
            absmax[-1] = absmax[-2]
        return absmax


class RowwiseAbsmax(TorchNF4Backend):
    """Indexes absmax per row (row * ceil(K / blocksize) + k // blocksize) instead of over
    the flattened tensor: right whenever rows hold whole blocks, wrong when a block starts
    mid-row. The class of bitsandbytes 0.50.2's CPU dequantize bug (known_failures.toml);
    like it, odd row lengths take the correct flat path."""

    name = "mutant-rowwise-absmax"
    catches = "dequantize"

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        if len(q.shape) != 2 or q.shape[1] % 2:
            return super().dequantize(q, dtype)
        h = q.handle
        rows, cols = q.shape
        bs = h["blocksize"]
        codes = self.unpack(h["packed"], rows * cols).reshape(rows, cols)
        per_row = math.ceil(cols / bs)
        index = torch.arange(rows).unsqueeze(1) * per_row + torch.arange(cols).unsqueeze(0) // bs
        absmax = self.decode_absmax(h)
        index = index.clamp(max=absmax.numel() - 1).to(absmax.device)
        return (h["code"][codes.long()] * absmax[index]).to(dtype)


class DroppedNestedOffset(TorchNF4Backend):
    """Decodes a double-quantized absmax without adding back the mean offset."""

    name = "mutant-dropped-dq-offset"
    catches = "dequantize"

    def decode_absmax(self, h: dict) -> torch.Tensor:
        if "nested_absmax" not in h:
            return h["absmax"]
        return super().decode_absmax(h) - h["offset"]


class IgnoredBias(TorchNF4Backend):
    name = "mutant-ignored-bias"
    catches = "matmul"

    def matmul(self, x, q, bias, compute_dtype):
        return super().matmul(x, q, None, compute_dtype)


class WrongGemvTail(TorchNF4Backend):
    """A batch-1 fast path that drops the partial last tile of K (a gemv tail bug)."""

    name = "mutant-gemv-tail"
    catches = "matmul"
    TILE = 32

    def matmul(self, x, q, bias, compute_dtype):
        if math.prod(x.shape[:-1]) != 1:
            return super().matmul(x, q, bias, compute_dtype)
        k = x.shape[-1]
        w = self.dequantize(q, compute_dtype)
        full = (k // self.TILE) * self.TILE if k % self.TILE else k - self.TILE
        y = F.linear(x[..., :full].to(compute_dtype), w[:, :full], bias.to(compute_dtype) if bias is not None else None)
        return y.to(x.dtype)


class LastRowAtTheFusedLimit(TorchNF4Backend):
    """A fused small-batch path, claimed up to 4 rows through ``max_gemv_rows``, whose
    4-row case computes its last output row from x's third row (an off-by-one in the last
    row group). The drawn activations never have 4 rows: only the row-count sweep sees it."""

    name = "mutant-fused-limit-last-row"
    catches = "matmul"
    LIMIT = 4

    def capabilities(self, device):
        return dataclasses.replace(super().capabilities(device), max_gemv_rows=self.LIMIT)

    def matmul(self, x, q, bias, compute_dtype):
        if math.prod(x.shape[:-1]) != self.LIMIT:
            return super().matmul(x, q, bias, compute_dtype)
        rows = x.reshape(self.LIMIT, x.shape[-1])
        shifted = torch.cat([rows[:-1], rows[-2:-1]])
        return super().matmul(shifted, q, bias, compute_dtype).reshape(*x.shape[:-1], -1)


def gradient_altered(y: torch.Tensor, alter) -> torch.Tensor:
    """``y`` unchanged, its gradient passed through ``alter`` (given a copy) on the way back:
    a bug in a backward only."""

    class Altered(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, dy):
            return alter(dy.clone())

    return Altered.apply(y)


class NaNGradients(TorchNF4Backend):
    """A backward that produces NaN where a weight block is all zeros (0/0 in a rescale)."""

    name = "mutant-nan-grad"
    catches = "backward"

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        if not y.requires_grad:
            return y

        def poison(dy):
            dy[..., 0] = float("nan")  # one output feature's gradient is NaN
            return dy

        return gradient_altered(y, poison)


class Fp16Accumulation(TorchNF4Backend):
    """Accumulates the matmul in fp16 (overflows on large cancelling products)."""

    name = "mutant-fp16-accumulate"
    catches = "backward"

    def matmul(self, x, q, bias, compute_dtype):
        if compute_dtype != torch.float16:
            return super().matmul(x, q, bias, compute_dtype)
        w = self.dequantize(q, torch.float16)
        prods = x.to(torch.float16).unsqueeze(-2) * w  # [..., N, K] in fp16
        y = torch.cumsum(prods, dim=-1)[..., -1]
        return (y + bias.to(torch.float16) if bias is not None else y).to(x.dtype)


class ForgetsBlocksize(TorchNF4Backend):
    """A serializer that does not store the blocksize; the loader assumes ROCm's 128."""

    name = "mutant-forgets-blocksize"
    catches = "interop"

    def serialize(self, q):
        state = super().serialize(q)
        del state["blocksize"]
        return state

    def load(self, state, device):
        return super().load({**state, "blocksize": torch.tensor(128)}, device)

    def validate(self, state):
        """Checks nothing, as the loaders of this class of bug did: the example backend's own
        size check would refuse the guessed blocksize (absmax twice as long as it needs)."""


class OffThresholds(TorchNF4Backend):
    """Quantization thresholds shifted by 2% of a code gap towards zero."""

    name = "mutant-off-thresholds"
    catches = "quantize"

    def quantize_codes(self, flat, absmax, blocksize, table):
        scale = absmax.repeat_interleave(blocksize)[: flat.numel()]
        scaled = torch.where(scale > 0, flat / scale, torch.zeros_like(flat))
        return super().quantize_codes(scaled * 0.99 + 0.0, torch.ones_like(absmax), blocksize, table)


class WrongOutputDtype(TorchNF4Backend):
    """Always dequantizes to fp32 whatever dtype was asked for."""

    name = "mutant-wrong-dtype"
    catches = "dequantize"

    def dequantize(self, q, dtype):
        return super().dequantize(q, torch.float32)


class NaNForZeroBlocks(TorchNF4Backend):
    """Normalizes by absmax on decode too, so all-zero blocks decode to NaN (0/0)."""

    name = "mutant-nan-zero-blocks"
    catches = "dequantize"

    def dequantize(self, q, dtype):
        out = super().dequantize(q, torch.float32)
        absmax = self.decode_absmax(q.handle).repeat_interleave(q.handle["blocksize"])[: out.numel()]
        return (out.reshape(-1) * (absmax / absmax)).to(dtype).reshape(q.shape)


class HidesNonFinite(TorchNF4Backend):
    """Sanitizes NaN/Inf activations to zero (hides a poisoned input)."""

    name = "mutant-hides-nonfinite"
    catches = "backward"

    def matmul(self, x, q, bias, compute_dtype):
        return super().matmul(torch.nan_to_num(x, 0.0, 0.0, 0.0), q, bias, compute_dtype)


class CrashesOnFp32Input(TorchNF4Backend):
    """HQQ's bug class: a bf16 layer that does not cast fp32 activations."""

    name = "mutant-fp32-input-crash"
    catches = "matmul-fp32-input"

    def matmul(self, x, q, bias, compute_dtype):
        w = self.dequantize(q, compute_dtype)
        return torch.matmul(x, w.t())  # dtype mismatch raises for fp32 x and bf16 w


class ScaledMatmul(TorchNF4Backend):
    """A systematic relative error ``eps`` in the matmul output (set per instance)."""

    name = "mutant-scaled-matmul"
    catches = "matmul"
    eps = 1e-2

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        return (y.double() * (1 + scaled_matmul_eps(compute_dtype, self.eps))).to(y.dtype)


# -- issue 18: bugs that only the inputs users have reach ------------------------------------
# The checks these mutants' classes need (suite modules, with ".py" so that a test named
# like a module elsewhere, such as interop's test_checkpoint_decodes_exactly_after_reload,
# is not taken along, or test functions, as ``-k`` names). The zoo runs them against these mutants and the correct backend only (every
# other mutant's class is caught by the original suites), which keeps the zoo's run time
# from growing with the product of both lists.
USER_INPUT_SUITES: tuple[str, ...] = (
    "test_quantize_every_claimed_blocksize",
    "test_weight_layouts.py",
    "test_storage.py",
    "test_parameters.py",
    "test_value_ranges.py",
    "test_real_shapes.py",
)


class IndexWrapsPast2To17(TorchNF4Backend):
    """Block indices wrap past 2^17 elements (a 17-bit index in a kernel): every weight
    beyond the first 131072 elements is scaled by another block's absmax. No drawn weight
    is that large; the CPU layer shapes are (136 x 1000)."""

    name = "mutant-index-wraps-2-17"
    catches = "real-shapes"
    suites = USER_INPUT_SUITES
    WRAP = 1 << 17

    def dequantize_with(self, q, dtype, *, out=None, absmax=None):
        h = q.handle
        numel = math.prod(q.shape)
        if numel <= self.WRAP or absmax is not None:
            return super().dequantize_with(q, dtype, out=out, absmax=absmax)
        codes = self.unpack(h["packed"].view(torch.uint8), numel)
        block = (torch.arange(numel, device=codes.device) % self.WRAP) // h["blocksize"]
        values = (h["code"][codes.long()] * self.decode_absmax(h)[block]).to(dtype).reshape(q.shape)
        return values if out is None else out.copy_(values)


class AbsmaxOverOneTile(TorchNF4Backend):
    """Quantize takes each block's absmax over its first 1024 elements only (one thread
    block's tile): right up to blocksize 1024, wrong at 2048 and 4096, yet the bytes decode
    consistently with the absmax stored, so only the comparison with the reference
    quantizer at every claimed blocksize sees it."""

    name = "mutant-absmax-one-tile"
    catches = "quantize"
    suites = USER_INPUT_SUITES
    zoo_blocksizes = (64, 2048, 4096)
    TILE = 1024

    def quantize(self, weight, spec):
        if spec.blocksize <= self.TILE:
            return super().quantize(weight, spec)
        flat = weight.detach().reshape(-1).float()
        padded = F.pad(flat, (0, (-flat.numel()) % spec.blocksize))
        absmax = padded.reshape(-1, spec.blocksize)[:, : self.TILE].abs().amax(dim=1)
        table = self.table(spec.format, flat.device)
        handle = {
            "packed": self.pack(self.quantize_codes(flat, absmax, spec.blocksize, table)),
            "code": table,
            "absmax": absmax,
            "blocksize": spec.blocksize,
            "quant_type": spec.format,
        }
        if spec.double_quant:
            handle.update(self.nest(absmax))
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, handle)


class ReadsStorageInMemoryOrder(TorchNF4Backend):
    """Quantize reads the weight's storage in memory order from its first element (a raw
    data pointer handed to a kernel), ignoring strides: right for contiguous weights,
    silently wrong for a transposed or sliced one."""

    name = "mutant-memory-order"
    catches = "quantize-layout"
    suites = USER_INPUT_SUITES

    def quantize(self, weight, spec):
        if not weight.is_contiguous():
            weight = torch.as_strided(
                weight, tuple(weight.shape), torch.empty(weight.shape).stride(), weight.storage_offset()
            )
        return super().quantize(weight, spec)


class StorageCastByValueOnLoad(TorchNF4Backend):
    """Loading a checkpoint whose packed weight is stored as bf16/fp16/fp32 converts the
    values to uint8 instead of viewing the bytes (``.to(torch.uint8)``)."""

    name = "mutant-storage-cast-on-load"
    catches = "storage"
    suites = USER_INPUT_SUITES

    def load(self, state, device):
        packed = state["packed"]
        if packed.dtype != torch.uint8:
            state = {**state, "packed": packed.to(torch.uint8)}
        return super().load(state, device)


class OutBufferKeepsFirstDtype(TorchNF4Backend):
    """dequantize(out=) decodes into a staging buffer made at the first call and resized
    on a new shape but never retyped, then copies it into out: the global-buffer class of
    unsloth PR 4026 behind the caller's own out= buffer."""

    name = "mutant-out-buffer-first-dtype"
    catches = "parameters"
    suites = USER_INPUT_SUITES

    def __init__(self) -> None:
        self.staging: torch.Tensor | None = None

    def dequantize_with(self, q, dtype, *, out=None, absmax=None):
        fresh = super().dequantize_with(q, dtype, absmax=absmax)
        if out is None:
            return fresh
        if self.staging is None:
            self.staging = torch.empty_like(fresh)
        elif self.staging.shape != fresh.shape:
            self.staging = torch.empty(fresh.shape, dtype=self.staging.dtype, device=fresh.device)
        self.staging.copy_(fresh)
        return out.copy_(self.staging)


class ExplicitAbsmaxAssumesBlocksize64(TorchNF4Backend):
    """The stateless dequantize (bytes plus an absmax= tensor) ignores the blocksize it
    is given and uses the CUDA default, 64."""

    name = "mutant-explicit-absmax-b64"
    catches = "parameters"
    suites = USER_INPUT_SUITES

    def dequantize_with(self, q, dtype, *, out=None, absmax=None):
        if absmax is None or q.handle["blocksize"] == 64:
            return super().dequantize_with(q, dtype, out=out, absmax=absmax)
        h = q.handle
        numel = math.prod(q.shape)
        codes = self.unpack(h["packed"].view(torch.uint8), numel)
        scales = absmax.repeat_interleave(64)[:numel]
        scales = F.pad(scales, (0, numel - scales.numel()), value=float(absmax[-1]))
        values = (h["code"][codes.long()] * scales).to(dtype).reshape(q.shape)
        return values if out is None else out.copy_(values)


class BiasKeepsItsDtype(TorchNF4Backend):
    """Adds the bias in its own dtype after the product (``y + bias``), so a bias of
    another dtype promotes the result: an fp32 bias turns a bf16 layer's output fp32."""

    name = "mutant-bias-keeps-dtype"
    catches = "parameters"
    suites = USER_INPUT_SUITES

    def matmul_with(self, x, q, bias, compute_dtype, *, out=None, orientation="default"):
        y = super().matmul_with(x, q, None, compute_dtype, out=out, orientation=orientation)
        return y if bias is None else y + bias


class HalfPrecisionBackwardForBf16(TorchNF4Backend):
    """The backward of a bf16 layer computes ``dx = dy W`` in fp16 (a kernel that has
    only a half-precision path): fine for ordinary gradients, inf beyond fp16's range."""

    name = "mutant-fp16-backward-for-bf16"
    catches = "value-range"
    suites = USER_INPUT_SUITES

    def matmul(self, x, q, bias, compute_dtype):
        if compute_dtype != torch.bfloat16:
            return super().matmul(x, q, bias, compute_dtype)
        w = self.dequantize(q, compute_dtype)

        class Linear(torch.autograd.Function):
            @staticmethod
            def forward(ctx, inp, b):
                return F.linear(inp, w, b)

            @staticmethod
            def backward(ctx, dy):
                dx = (dy.to(torch.float16) @ w.to(torch.float16)).to(dy.dtype)
                return dx, dy.reshape(-1, dy.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None

        b = bias.to(compute_dtype) if bias is not None else None
        return Linear.apply(x.to(compute_dtype), b).to(x.dtype)


def scaled_matmul_eps(dtype: torch.dtype, default: float) -> float:
    """``QCONFORM_MUTANT_EPS``: one eps for every dtype ("0.01") or a JSON object per
    dtype ('{"bf16": 0.0078}'), so a sensitivity sweep needs no code change."""
    raw = os.environ.get("QCONFORM_MUTANT_EPS")
    if raw is None:
        return default
    if raw.lstrip().startswith("{"):
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        return float(json.loads(raw).get(name, 0.0))
    return float(raw)


# -- layer mutants (issue 19): each plants its bug in the example backend's layer ------------------------


# The layer suites (as ``-k`` names): the zoo runs them against the layer mutants and the
# correct backend only, as it does the issue-18 suites.
LAYER_SUITES: tuple[str, ...] = ("test_layers.py", "test_layer_lifecycle.py", "test_checkpoint.py", "test_peft.py")


def layers_building(backend, layer_class: type = FunctionalLinear) -> FunctionalLayers:
    """``backend``'s functional layer facet, building ``layer_class`` (a planted layer bug)."""
    return type("MutantLayers", (FunctionalLayers,), {"layer_class": layer_class})(backend)


class _LayerMutant(TorchNF4Backend):
    """Base of the layer mutants: the correct backend whose layer facet builds ``layer_class``."""

    layer_class: type = FunctionalLinear
    suites = LAYER_SUITES

    def layers(self):
        return layers_building(self, self.layer_class)


class _EvalTransposedAbsmaxLinear(FunctionalLinear):
    def forward(self, x):
        if self.training or torch.is_grad_enabled():
            return super().forward(x)
        handle = dict(self.quantized.handle)
        rows = self.out_features
        handle["absmax"] = handle["absmax"].reshape(rows, -1).T.reshape(-1)
        return self.backend.matmul(x, dataclasses.replace(self.quantized, handle=handle), self.bias, self.compute_dtype)


class EvalPathTransposedAbsmax(_LayerMutant):
    """bitsandbytes' CPU class: an eval-mode, no-grad fast path that reads absmax in a
    transposed [K/blocksize, N] order; train mode and grad are right."""

    name = "mutant-layer-eval-absmax"
    catches = "layer-forward"
    layer_class = _EvalTransposedAbsmaxLinear


class _RoundsCodeTableLinear(FunctionalLinear):
    def forward(self, x):
        with torch.no_grad():
            self.quant_code.copy_(self.quant_code.to(self.compute_dtype))
        self._rebuild()
        return super().forward(x)


class ForwardRoundsStoredState(_LayerMutant):
    """A forward that rounds the stored code table to the compute dtype in place (the
    stored state follows the last forward's dtype)."""

    name = "mutant-layer-rounds-state"
    catches = "layer-state"
    layer_class = _RoundsCodeTableLinear


class _KeepsOwnBlocksizeLinear(FunctionalLinear):
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        own = self.quant_blocksize.clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.quant_blocksize.copy_(own)
        self._rebuild()


class LoadKeepsPlatformBlocksize(_LayerMutant):
    """unsloth's AMD class at layer level: loading a checkpoint keeps the loading layer's
    own (platform default) blocksize instead of the checkpoint's."""

    name = "mutant-layer-load-blocksize"
    catches = "checkpoint"
    layer_class = _KeepsOwnBlocksizeLinear


class _CastsStateLinear(FunctionalLinear):
    def _apply(self, fn, recurse=True):
        torch.nn.Module._apply(self, fn, recurse)
        self._rebuild()
        return self


class HalfCastsQuantState(_LayerMutant):
    """A layer whose quantization state is plain float buffers: ``model.half()`` rounds
    absmax and the code table to fp16."""

    name = "mutant-layer-half-casts-state"
    catches = "device-move"
    layer_class = _CastsStateLinear


class _SharedBufferLinear(FunctionalLinear):
    def forward(self, x):
        weight = self.backend.dequantize(self.quantized, self.compute_dtype).reshape(-1)
        buffer = getattr(self.backend, "shared_buffer", None)
        if buffer is None or buffer.numel() < weight.numel():
            buffer = torch.empty(weight.numel(), dtype=self.compute_dtype, device=weight.device)
            self.backend.shared_buffer = buffer
        buffer[: weight.numel()].copy_(weight)
        w = buffer[: weight.numel()].reshape(self.out_features, self.in_features)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return F.linear(x.to(self.compute_dtype), w, bias).to(x.dtype)


class SharedBufferKeepsFirstDtype(_LayerMutant):
    """unsloth PR 4026 at layer level: every layer of every model dequantizes into one
    buffer held by the backend, allocated in the first model's dtype and only ever grown."""

    name = "mutant-layer-shared-buffer"
    catches = "layer-sequencing"
    layer_class = _SharedBufferLinear


MUTANTS: tuple[type[Backend], ...] = (
    KeepsFirstDtypeBuffer,
    SwappedNibbles,
    WrongBlockAbsmax,
    RowwiseAbsmax,
    DroppedNestedOffset,
    IgnoredBias,
    WrongGemvTail,
    NaNGradients,
    Fp16Accumulation,
    ForgetsBlocksize,
    OffThresholds,
    WrongOutputDtype,
    NaNForZeroBlocks,
    HidesNonFinite,
    CrashesOnFp32Input,
    ScaledMatmul,
    LastRowAtTheFusedLimit,
    IndexWrapsPast2To17,
    AbsmaxOverOneTile,
    ReadsStorageInMemoryOrder,
    StorageCastByValueOnLoad,
    OutBufferKeepsFirstDtype,
    ExplicitAbsmaxAssumesBlocksize64,
    BiasKeepsItsDtype,
    HalfPrecisionBackwardForBf16,
    EvalPathTransposedAbsmax,
    ForwardRoundsStoredState,
    LoadKeepsPlatformBlocksize,
    HalfCastsQuantState,
    SharedBufferKeepsFirstDtype,
)


# The blocksizes the zoo's backends claim: the CUDA and ROCm defaults, unless a mutant's
# bug needs others (``zoo_blocksizes``). Every check depends on the blocksize, so every
# claimed blocksize multiplies the zoo's run time; the full range is the correct backend's
# in the downstream example's own run (nox -s downstream). Likewise the widest weight: the
# two narrower lm_head widths (one of them odd), unless a mutant needs the widest.
ZOO_BLOCKSIZES: tuple[int, ...] = (64, 128)
ZOO_MAX_OUT_FEATURES = 50257


def narrowed(backend: type[Backend]) -> type[Backend]:
    """``backend`` claiming only ``ZOO_BLOCKSIZES`` (or its own ``zoo_blocksizes``) and
    weights up to ``ZOO_MAX_OUT_FEATURES`` wide (or its own ``zoo_max_out_features``)."""
    blocksizes = getattr(backend, "zoo_blocksizes", ZOO_BLOCKSIZES)
    max_out_features = getattr(backend, "zoo_max_out_features", ZOO_MAX_OUT_FEATURES)

    def capabilities(self, device):
        return dataclasses.replace(
            backend.capabilities(self, device), blocksizes=blocksizes, max_out_features=max_out_features
        )

    return type(backend.__name__, (backend,), {"capabilities": capabilities})


# -- issue 26: classes no earlier issue named ---------------------------------------------------------------


class Fp32AbsmaxMean(TorchNF4Backend):
    """The stored state is not finite: double quantization sums absmax in fp32 for its mean
    offset, which overflows to inf for weights near fp32's largest value (bitsandbytes
    0.50.2 does this; known_failures.toml). The reference decodes the inf state to the
    same NaN and inf the backend returns, so only a check against the input sees it."""

    name = "mutant-fp32-absmax-mean"
    catches = "value-range"
    suites = USER_INPUT_SUITES

    def nest(self, absmax: torch.Tensor) -> dict:
        nested = super().nest(absmax)
        offset = float(absmax.float().sum() / absmax.numel())  # inf once the fp32 sum overflows
        if math.isinf(offset):
            nested = {**nested, "offset": offset, "nested_absmax": torch.full_like(nested["nested_absmax"], math.inf)}
        return nested


class TruncatingBf16Matmul(TorchNF4Backend):
    """triton-lang/triton#11217's class: bf16 results rounded toward zero (a truncating
    bf16 dot instruction on RDNA) rather than to nearest. Each error stays within the
    worst-case bound; all of them point toward zero."""

    name = "mutant-truncating-bf16-matmul"
    catches = "matmul"

    def matmul(self, x, q, bias, compute_dtype):
        if compute_dtype is not torch.bfloat16:
            return super().matmul(x, q, bias, compute_dtype)
        y = super().matmul(x.float(), q, None if bias is None else bias.float(), torch.float32)
        truncated = (y.contiguous().view(torch.int32) & -65536).view(torch.float32)  # keep the top 16 bits
        return truncated.to(torch.bfloat16).to(x.dtype)


class MisalignedActivation(TorchNF4Backend):
    """A kernel that assumes its input starts at the beginning of its storage (aligned
    vector loads from the storage pointer): an activation one element into its storage
    is read one element early."""

    name = "mutant-misaligned-activation"
    catches = "matmul"

    def matmul(self, x, q, bias, compute_dtype):
        if x.is_contiguous() and x.storage_offset() % 8:
            x = torch.as_strided(x, x.shape, x.stride(), storage_offset=x.storage_offset() - 1)
        return super().matmul(x, q, bias, compute_dtype)


class _Blocksize64ForwardLinear(FunctionalLinear):
    def forward(self, x):
        handle = self.quantized.handle
        if handle["blocksize"] == 64:
            return super().forward(x)
        absmax = self.backend.decode_absmax(handle)
        blocks_of_64 = -(-math.prod(self.quantized.shape) // 64)
        wrong = {key: value for key, value in handle.items() if key not in ("nested_absmax", "nested_code", "offset")}
        wrong.update(blocksize=64, absmax=absmax[torch.arange(blocks_of_64, device=absmax.device) % absmax.numel()])
        return self.backend.matmul(x, dataclasses.replace(self.quantized, handle=wrong), self.bias, self.compute_dtype)


class LayerForwardAssumesBlocksize64(_LayerMutant):
    """A layer whose forward kernel hard-codes blocksize 64 and reads absmax per 64
    elements: right at the CUDA default, wrong at 128 (the ROCm default and the blocksize
    of many published checkpoints), which the layer suites never ran before their
    parameters came from the backend's claims."""

    name = "mutant-layer-forward-b64-only"
    catches = "layer-forward"
    layer_class = _Blocksize64ForwardLinear


class OutputsPastGridLimit(TorchNF4Backend):
    """A matmul kernel launched with one program per output feature on a grid axis that
    CUDA caps at 65535: the outputs past it are never written (left zero). No drawn or
    layer shape comes near; a real vocabulary does (Qwen2's lm_head: 151936)."""

    name = "mutant-outputs-past-grid-limit"
    catches = "matmul"
    zoo_max_out_features = None  # the widest lm_head too
    GRID_LIMIT = 65535

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        if y.shape[-1] > self.GRID_LIMIT:
            y = y.clone()
            y[..., self.GRID_LIMIT :] = 0
        return y


MUTANTS += (
    Fp32AbsmaxMean,
    TruncatingBf16Matmul,
    MisalignedActivation,
    LayerForwardAssumesBlocksize64,
    OutputsPastGridLimit,
)


# -- compiled and captured paths (issue 26) ------------------------------------------------------

# The suite of those paths (a ``-k`` name): the zoo runs it against these mutants and the correct backend.
PATH_SUITES: tuple[str, ...] = ("test_compiled.py",)


class CompiledFallbackSwapsNibbles(TorchNF4Backend):
    """A second decode that only the compiled path takes (a ``torch.compiler.is_compiling()``
    branch around a kernel dynamo cannot trace, as libraries write them) and that reads the
    low nibble as the first element: every eager check passes, every compiled call is wrong."""

    name = "mutant-compiled-fallback"
    catches = "compiled"
    suites = PATH_SUITES

    def unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.stack([packed & 0xF, packed >> 4], dim=1).reshape(-1)[:numel]
        return super().unpack(packed, numel)


class StagedInputKeptByIdentity(TorchNF4Backend):
    """matmul stages x in a copy of its own and skips the copy when handed the same tensor
    object, unchanged (its version counter), as last time: right in eager, where an in-place
    write bumps the version, but a CUDA graph is captured from a call whose x the warm-up
    already staged, so the graph holds no copy and every replay multiplies the warm-up's
    input. The class of host-side caches keyed on tensor identity. Needs a GPU to be caught."""

    name = "mutant-captured-stale-input"
    catches = "captured"
    suites = PATH_SUITES
    needs_gpu = True

    def __init__(self) -> None:
        self.staged: tuple[weakref.ref, int, torch.Tensor] | None = None

    def matmul(self, x, q, bias, compute_dtype):
        if self.staged is None or self.staged[0]() is not x or self.staged[1] != x._version:
            self.staged = (weakref.ref(x), x._version, x.clone())
        return super().matmul(self.staged[2], q, bias, compute_dtype)


MUTANTS += (CompiledFallbackSwapsNibbles, StagedInputKeptByIdentity)


# -- issue 36: a bug of one route and one layout -----------------------------------------------------


class TwoRowKernelMisreadsOffset(TorchNF4Backend):
    """A kernel of its own for two rows (declared: ``dispatch_rows`` 2 and 3, between the
    gemv for one row and the GEMM from three) that loads x with aligned vector loads from
    where its storage would start: an activation one element into its storage is read one
    element early there, and only there (the other routes read it right, and an fp32
    activation is cast first, into a fresh aligned tensor). The old checks never ran that
    pair: the matmul check drew its rows (1, 3, 10, 16 or 40; its listed case 5) apart from
    its layout axis, and the route check ran its rows (2 among them) with contiguous x only.
    As axes, (2 rows, offset) is an instance of both."""

    name = "mutant-two-row-kernel-offset"
    catches = "matmul"
    ROWS = 2

    def capabilities(self, device):
        return dataclasses.replace(super().capabilities(device), dispatch_rows=(self.ROWS, self.ROWS + 1))

    def matmul(self, x, q, bias, compute_dtype):
        xc = x.to(compute_dtype)  # the adapter's cast: a new tensor, aligned, unless x has the dtype
        if math.prod(x.shape[:-1]) == self.ROWS and xc.is_contiguous() and xc.storage_offset() % 8:
            xc = torch.as_strided(xc, xc.shape, xc.stride(), storage_offset=xc.storage_offset() - 1)
        return super().matmul(xc, q, bias, compute_dtype).to(x.dtype)


MUTANTS += (TwoRowKernelMisreadsOffset,)


class RouteKeepsItsFirstInput(TorchNF4Backend):
    """A route that keeps its first call's activation per weight and activation layout and
    multiplies every later call of that layout by it (with the later call's bias): the class
    of host state kept between calls for speed, keyed too coarsely (a bound launch's TMA
    descriptor encoded once, a staging buffer, a plan that captured its first x; issue 52).
    Each call alone is right, so a check that calls each weight once passes it; the route
    check calls each weight twice, with two activations of one layout."""

    name = "mutant-route-keeps-first-input"
    catches = "matmul"

    def __init__(self) -> None:
        self.first: dict[tuple, tuple[weakref.ref, torch.Tensor]] = {}

    def matmul(self, x, q, bias, compute_dtype):
        key = (id(q), x.shape, x.stride(), x.storage_offset() % 8, x.dtype)
        kept = self.first.get(key)
        if kept is None or kept[0]() is not q:
            kept = self.first[key] = (weakref.ref(q), x.clone())
        return super().matmul(kept[1], q, bias, compute_dtype)


MUTANTS += (RouteKeepsItsFirstInput,)


# -- gemlite's conversion of an HQQ layer (hqq-gemlite) ------------------------------------------
# Mutants of the CPU stand-in for hqq-gemlite (``torch_gemlite4``: HQQ's layer stored as
# gemlite's conversion stores it, multiplied in plain PyTorch), since gemlite itself needs a
# GPU. Each plants a bug in one step: the conversion's words, its scales, the kernel's decode.
# In the original run, with the correct stand-in in every run.


class GemliteNibbleOrderReversed(TorchGemlite4Backend):
    """A conversion that writes code ``j`` of a word into bits ``28 - 4 j`` while the kernel
    reads gemlite's bits ``4 j``: every matmul agrees with the reference's decoding of the
    stored words (the kernel is right), so only the stored codes against the nearest levels
    of the input show it."""

    name = "mutant-gemlite-nibble-order"
    catches = "quantize"

    def pack(self, codes: np.ndarray) -> np.ndarray:
        return reversed_nibbles(super().pack(codes))


class GemliteScaleOfPreviousGroup(TorchGemlite4Backend):
    """A conversion that stores each group's scale from the group before it (an off-by-one
    in the group index, the first group taking the last's), its zero right: the kernel
    decodes what is stored, consistently; the codes no longer are the input's nearest levels."""

    name = "mutant-gemlite-neighbour-scale"
    catches = "quantize"

    def convert(self, layer, dtype):
        right = super().convert(layer, dtype)
        return dataclasses.replace(right, scale=np.roll(right.scale, 1, axis=0))


class GemliteKernelReadsMode3(TorchGemlite4Backend):
    """A kernel that decodes every layer with mode 3, ``(q - zero) * scale``, also a grouped
    one converted to mode 4, whose stored zero is ``fl(-zero * scale)``: the stored state is
    right, the matmul is not."""

    name = "mutant-gemlite-kernel-mode-3"
    catches = "matmul"

    def dequantize_weight(self, q, compute_dtype):
        return super().dequantize_weight(dataclasses.replace(q, handle={**q.handle, "W_group_mode": 3}), compute_dtype)


MUTANTS += (GemliteNibbleOrderReversed, GemliteScaleOfPreviousGroup, GemliteKernelReadsMode3)


# -- lifecycle mutants (issue 26): bugs that need a sequence of steps to show ------------------------------


# The lifecycle suite (as a ``-k`` name): run against these mutants and the correct backend only; its
# drawn sequences cost a few seconds a cell, and shrinking a failing one more.
LIFECYCLE_SUITES: tuple[str, ...] = ("test_lifecycle_sequences.py",)


class _SavesKernelCacheLinear(FunctionalLinear):
    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        # a kernel-ready copy of the float quantization state in the compute dtype, made on every move or cast
        self.kernel_cache = {
            key: value.to(self.compute_dtype) for key, value in self.state().items() if value.is_floating_point()
        }
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for key, cached in getattr(self, "kernel_cache", {}).items():
            name = prefix + PREFIX + key
            destination[name] = cached.to(destination[name].dtype)


class CheckpointAfterMoveSavesKernelCache(_LayerMutant):
    """bitsandbytes' CPU-repack class, spread over two steps: every move or cast keeps a
    kernel-ready copy of absmax and the code table in the compute dtype, and ``state_dict``
    writes that copy. The layer computes right, and its own state is untouched; only a
    checkpoint written after a move (or ``.half()``) and loaded again decodes to other weights."""

    name = "mutant-layer-checkpoint-after-move"
    catches = "lifecycle"
    suites = LIFECYCLE_SUITES
    layer_class = _SavesKernelCacheLinear


MUTANTS = MUTANTS + (CheckpointAfterMoveSavesKernelCache,)


# -- issue 28: our own quantize kernel -------------------------------------------------------------------------
# Mutants of our Triton backend rather than of the plain-PyTorch one: the bug is in our kernel
# (``kernels.nf4_quantize``), reached with wrong data, the kernel itself unchanged. On the CPU
# the kernels run in Triton's interpreter, too slow for the zoo's full runs, so
# tests/test_mutant_zoo.py runs these checks against them and the real triton-nf4 alone.
KERNEL_SUITES: tuple[str, ...] = ("test_quantize_codes_and_absmax_match_reference",)


class KernelRoundsTowardZero(TritonNf4Backend):
    """Our quantize kernel picks the wrong code at one boundary: the one between 0 and the
    first positive code sits on that code instead of midway, so a scaled value in between
    (NF4: 0.0398 to 0.0796, a few % of a normal weight) rounds toward zero. Every byte
    still decodes consistently with the absmax stored; only the reference's codes show it."""

    name = "mutant-kernel-toward-zero"
    catches = "quantize"
    suites = KERNEL_SUITES

    def code_boundaries(self, quant_type, device):
        right = super().code_boundaries(quant_type, device)
        table = code_table(quant_type, right.midpoints.device).double()
        midpoints = right.midpoints.clone()
        midpoints[right.zero_rank] = table[int(right.rank_codes[right.zero_rank + 1])]
        return dataclasses.replace(right, midpoints=midpoints)


KERNEL_MUTANTS: tuple[type[TritonNf4Backend], ...] = (KernelRoundsTowardZero,)


# -- issue 52: our fused tensor-core GEMM's route -----------------------------------------------------------------
# The route (``kernels.nf4_tc_gemm``, past the fused kernels' rows up to ``TC_MAX_ROWS`` of the arch class)
# is on where it was measured faster (sm_90), off in Triton's interpreter. The zoo's run turns it on for
# the interpreter at sm_90's rows (tests/test_mutant_zoo.py, ``TC_ROUTE_CONFTEST``), so that the matmul check meets the
# real route at its rows under the twin's name, and the mutant's planted bug on that route only.
TC_ROUTE_SUITES: tuple[str, ...] = ("test_matmul_every_route",)


class TritonTcRoute(TritonNf4Backend):
    """The real Triton backend, named apart: the zoo's run takes its tensor-core GEMM route."""

    name = "triton-nf4-tc-route"


class TcRouteReadsNeighbourAbsmax(TritonTcRoute):
    """The tensor-core GEMM route fed each block's neighbour's absmax (the absmax tensor
    shifted by one: an off-by-one in the block index of the route's launch), the kernel
    itself unchanged; the rows the fused kernels take and those past the route are right."""

    name = "mutant-tc-route-neighbour-absmax"
    catches = "matmul"
    suites = TC_ROUTE_SUITES

    def linear(self, x, state, bias):
        from qconform_triton_nf4 import kernels

        K = state.shape[1]
        rows = math.prod(x.shape[:-1])
        fused = kernels.fused_rows_limit(x, state.packed, K)
        if fused < rows <= kernels.tc_max_rows(x.device) and kernels.tc_gemm_readable(x, K):
            absmax = state.absmax.reshape(-1).roll(1)
            return kernels.tc_gemm_4bit(x, state.packed, absmax, bias=bias, **state.kernel_args())
        return super().linear(x, state, bias)


TC_ROUTE_MUTANTS: tuple[type[TritonNf4Backend], ...] = (TcRouteReadsNeighbourAbsmax,)


# The warp-specialized GEMM's route (``kernels.nf4_ws_gemm``, Gluon: sm_90 only, no interpreter), from
# ``WS_MIN_ROWS`` to ``WS_MAX_ROWS``: its zoo run is a GPU's (``needs_gpu``).
class TritonWsRoute(TritonNf4Backend):
    """The real Triton backend, named apart: on an sm_90 GPU it takes the warp-specialized GEMM route."""

    name = "triton-nf4-ws-route"


class WsRouteReadsNeighbourAbsmax(TritonWsRoute):
    """The warp-specialized GEMM route fed each block's neighbour's absmax (an off-by-one in
    the block index of the route's launch), the kernel itself unchanged; the rows the other
    routes take are right."""

    name = "mutant-ws-route-neighbour-absmax"
    catches = "matmul"
    suites = TC_ROUTE_SUITES
    needs_gpu = True

    def linear(self, x, state, bias):
        from qconform_triton_nf4 import kernels, plans

        if plans.takes_ws_route(x, state.packed, state.kernel_args()):
            absmax = state.absmax.reshape(-1).roll(1)
            return kernels.ws_gemm_4bit(x, state.packed, absmax, bias=bias, **state.kernel_args())
        return super().linear(x, state, bias)


WS_ROUTE_MUTANTS: tuple[type[TritonNf4Backend], ...] = (WsRouteReadsNeighbourAbsmax,)


# -- issue 36: bugs only a real workload's calls show ----------------------------------------------------------
# The workload suite (a ``-k`` name), run against these mutants and the correct backend only: each
# builds whole models, so the original mutants are not run through it.
WORKLOAD_SUITES: tuple[str, ...] = ("test_workloads.py",)


class _InferenceModeDropsBiasLinear(FunctionalLinear):
    def forward(self, x):
        if torch.is_inference_mode_enabled():
            return self.backend.matmul(x, self.quantized, None, self.compute_dtype)
        return super().forward(x)


class InferenceModeDropsBias(_LayerMutant):
    """A layer whose inference-mode fast path (what serving code runs under
    ``torch.inference_mode``) forgets the bias: every check that calls the layer with or
    without grad passes; a served model with biased projections (Qwen2's q/k/v, GPT-2's
    Conv1D layers) computes wrong at every call."""

    name = "mutant-inference-mode-drops-bias"
    catches = "workload:serving"
    suites = WORKLOAD_SUITES
    layer_class = _InferenceModeDropsBiasLinear


class _DecodeStepMixesSequencesLinear(FunctionalLinear):
    def forward(self, x):
        y = super().forward(x)
        if x.dim() == 3 and x.shape[0] > 1 and x.shape[1] == 1:  # one new token per sequence of a batch
            y = y.roll(1, dims=0)
        return y


class DecodeStepMixesSequences(_LayerMutant):
    """A layer whose path for a KV-cached decode step of a batch (activations of shape
    (batch, 1, K), one token per sequence) writes each sequence's output to the next
    sequence's row: right for one sequence and for every prefill, wrong at every
    generated token of a batched ``generate()``."""

    name = "mutant-decode-step-mixes-sequences"
    catches = "workload:generate"
    suites = WORKLOAD_SUITES
    layer_class = _DecodeStepMixesSequencesLinear


MUTANTS = MUTANTS + (InferenceModeDropsBias, DecodeStepMixesSequences)


class _Tf32WhenEvaluatingLinear(FunctionalLinear):
    def forward(self, x):
        if self.compute_dtype is not torch.float32 or self.training or torch.is_grad_enabled():
            return super().forward(x)

        def tf32(t):  # keep 10 of fp32's 23 fraction bits, as a TF32 tensor-core product reads its inputs
            return (t.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)

        w = self.backend.dequantize(self.quantized, torch.float32)
        y = tf32(x) @ tf32(w).T
        return (y + self.bias if self.bias is not None else y).to(x.dtype)


class Tf32WhenEvaluating(_LayerMutant):
    """fp32 requested, lower precision delivered (triton#10176: ``tl.dot`` defaults to TF32;
    bitsandbytes' CPU inference kernel computes fp32 layers in bf16): an fp32 layer whose
    inference path (eval, no grad) multiplies TF32-rounded inputs. Training-mode calls are
    exact; every ``generate()`` of an fp32 model is off by ~1e-3 relative."""

    name = "mutant-tf32-when-evaluating"
    catches = "workload:generate"
    suites = WORKLOAD_SUITES
    layer_class = _Tf32WhenEvaluatingLinear


MUTANTS = MUTANTS + (Tf32WhenEvaluating,)


class _CompiledDropsBiasLinear(FunctionalLinear):
    """A layer whose traced path (libraries branch on ``torch.compiler.is_compiling()``)
    forgets the bias: every eager call is right. The oracle's compiled queue must catch it
    (tests/test_watch.py, on the CPU through dynamo's tracing)."""

    def forward(self, x):
        if torch.compiler.is_compiling():
            return self.backend.matmul(x, self.quantized, None, self.compute_dtype)
        return super().forward(x)


class _CapturedDropsBiasLinear(FunctionalLinear):
    def forward(self, x):
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.backend.matmul(x, self.quantized, None, self.compute_dtype)
        return super().forward(x)


class CapturedDropsBias(_LayerMutant):
    """A layer that takes another path while a CUDA graph is captured (as serving stacks'
    custom ops branch on capture) and forgets the bias there: every eager call is right,
    and a served model whose decode step is captured (Qwen2's q/k/v) computes wrong at every
    replay. Caught only if the oracle judges captured calls, on the replayed values."""

    name = "mutant-captured-drops-bias"
    catches = "workload:captured"
    suites = WORKLOAD_SUITES
    layer_class = _CapturedDropsBiasLinear
    needs_gpu = True


MUTANTS = MUTANTS + (CapturedDropsBias,)


# -- bugs planted in the libraries a real backend stacks on (issue 36) ------------------------------------
# Each is the real backend under another name, with one public bug of its class planted into the
# library (transformers, PEFT, HQQ) by ``plant()`` when the zoo's conftest registers it: one run of its
# own each (the patch holds for the whole process), on the instances ``selection`` names, where the
# unpatched backend passes on this CPU. ``expect``: a regular expression the failure must match, so
# the cell fails for the planted bug and not for another.


def _bitsandbytes_backend():
    from pytest_qconform.backends.bitsandbytes import BitsandbytesBackend

    return BitsandbytesBackend


def _hqq_backend():
    from pytest_qconform.backends.hqq import HqqBackend

    return HqqBackend


class LibraryMutant:
    name: str
    catches: str
    selection: str  # pytest -k
    profile: str = "ci"
    expect: str
    base = staticmethod(_bitsandbytes_backend)

    @classmethod
    def backend(cls):
        return type(cls.__name__, (cls.base(),), {"name": cls.name})

    @staticmethod
    def plant() -> None:
        raise NotImplementedError


class ReentrantCheckpointWithoutInputGrads(LibraryMutant):
    """transformers#26221, peft#1142: reentrant gradient checkpointing over a frozen 4-bit
    base whose embedding output needs no grad (``enable_input_require_grads`` not applied):
    the checkpointed blocks' adapters get no gradient."""

    name = "mutant-lib-reentrant-no-input-grads"
    catches = "workload:qlora-step"
    selection = "test_qlora_training_step and reentrant and not non-reentrant"
    expect = r"does not require grad|adapters without a gradient"

    @staticmethod
    def plant() -> None:
        import transformers

        transformers.PreTrainedModel.enable_input_require_grads = lambda self: None


class HqqConstantGroupsNaN(LibraryMutant):
    """hqq#159: a constant group (max == min: a pruned neuron's row of zeros) scaled by
    ``15 / (max - min)``, infinite, so its stored zero is NaN. HQQ's own code guards it now;
    planted back into ``Quantizer.quantize``."""

    name = "mutant-lib-hqq-constant-group-nan"
    catches = "workload:generate"
    selection = "test_generate and not moe"
    expect = r"stored state (holds|decodes to) NaN"
    base = staticmethod(_hqq_backend)

    @staticmethod
    def plant() -> None:
        from hqq.core.quantize import Quantizer

        original = Quantizer.quantize.__func__

        def quantize(
            cls, tensor, nbits=4, channel_wise=True, group_size=64, optimize=True, round_zero=False, axis=0, **kw
        ):
            w_q, meta = original(cls, tensor, nbits, channel_wise, group_size, optimize, round_zero, axis, **kw)
            w = tensor.float().reshape([-1, group_size] if axis == 1 else [group_size, -1])
            constant = (w.max(dim=axis, keepdim=True)[0] == w.min(dim=axis, keepdim=True)[0]).to(meta["zero"].device)
            meta["zero"] = torch.where(constant, torch.full_like(meta["zero"], float("nan")), meta["zero"])
            return w_q, meta

        Quantizer.quantize = classmethod(quantize)


class PeftMergeDropsBias(LibraryMutant):
    """PEFT's LoRA merge rebuilding a quantized layer without its bias (the HQQ known
    failure's class), planted into PEFT's bitsandbytes ``Linear4bit.merge``."""

    name = "mutant-lib-peft-merge-drops-bias"
    catches = "workload:merge"
    selection = "test_merge_save_and_load and qwen2 and bf16"
    profile = "thorough"
    expect = r"its bias after merge_and_unload"

    @staticmethod
    def plant() -> None:
        from peft.tuners.lora.bnb import Linear4bit

        original = Linear4bit.merge

        def merge(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.get_base_layer().bias = None

        Linear4bit.merge = merge


def _hqq_gemlite_backend():
    from pytest_qconform.backends.hqq_gemlite import HqqGemliteBackend

    return HqqGemliteBackend


class GemliteGemvDropsBias(LibraryMutant):
    """A route only decoding takes, wrong: gemlite's gemv (1 to 4 activation rows, a
    generated token per sequence) planted to add no bias, its GEMM routes (the prompt's
    prefill) right. Reached only where the oracle watches the converted layer
    (``GemLiteLinearTriton``) inside generate; Qwen2's q/k/v carry biases. Needs a GPU."""

    name = "mutant-lib-gemlite-gemv-drops-bias"
    catches = "workload:generate"
    selection = "test_generate and qwen2"
    expect = r"forward: error is"
    base = staticmethod(_hqq_gemlite_backend)
    needs_gpu = True

    @staticmethod
    def plant() -> None:
        import gemlite.core

        original = gemlite.core.forward_functional

        def forward_functional(x, bias, tensor_args, meta_args, matmul_type=-1):
            rows = x.numel() // x.shape[-1]
            return original(x, None if rows <= 4 else bias, tensor_args, meta_args, matmul_type)

        gemlite.core.forward_functional = forward_functional


LIBRARY_MUTANTS: tuple[type[LibraryMutant], ...] = (
    ReentrantCheckpointWithoutInputGrads,
    HqqConstantGroupsNaN,
    PeftMergeDropsBias,
    GemliteGemvDropsBias,
)


# -- issue 37: models across devices and processes ---------------------------------------------------------------
# The multi-device suite (-m multi_gpu: two GPUs) and the distributed one (-m distributed: two ranks, gloo on
# the CPU), each run against these mutants and the correct backend. A distributed rank is a fresh process
# that rebuilds its backend from its class, so the correct backend is a module-level class here.
MULTI_GPU_SUITES: tuple[str, ...] = ("test_multi_device.py",)
DISTRIBUTED_SUITES: tuple[str, ...] = ("test_distributed.py",)


class CorrectTorchNF4(TorchNF4Backend):
    """The correct plain-PyTorch backend under the zoo's name for it."""

    name = "torch-nf4-correct"


class LaunchesOnTheCurrentDevice(TorchNF4Backend):
    """triton#2441's class: a matmul kernel launched on the current device, with pointers into
    another device's memory, writes nothing there: with the tensors on another GPU than the
    current one the output is the zeros it was allocated with (right on the current device)."""

    name = "mutant-current-device-launch"
    catches = "multi-gpu:matmul"
    suites = MULTI_GPU_SUITES
    needs_gpus = 2

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            return y * 0  # never written (kept differentiable: the backward is not this bug)
        return y


class CachesTheFirstDevice(TorchNF4Backend):
    """Host code that reads a device property once and keeps it for every device
    (bitsandbytes' ops.cu comment; gemlite 8cb34b3): the device of the first call, where
    dequantize allocates every output afterwards; a weight on another GPU is decoded onto it."""

    name = "mutant-cached-first-device"
    catches = "multi-gpu:dequantize"
    suites = MULTI_GPU_SUITES
    needs_gpus = 2

    def __init__(self) -> None:
        self.first_device: torch.device | None = None

    def dequantize(self, q, dtype):
        out = super().dequantize(q, dtype)
        if self.first_device is None:
            self.first_device = out.device
        return out.to(self.first_device)


class _StateOutsideBuffersLinear(FunctionalLinear):
    """The quantization state but its packed bytes held in a plain dict attribute, not as buffers."""

    def __init__(self, backend, quantized, bias, compute_dtype):
        super().__init__(backend, quantized, bias, compute_dtype)
        names = [name for name in self._buffers if name.startswith(PREFIX) and name != PREFIX + "packed"]
        self.kept = {name: self._buffers.pop(name) for name in names}

    def state(self):
        kept = getattr(self, "kept", {})  # FunctionalLinear.__init__ reads the state before this one's __init__ ends
        return {**super().state(), **{name.removeprefix(PREFIX): value for name, value in kept.items()}}

    def _load_from_state_dict(self, state_dict, prefix, *args):
        torch.nn.Module._load_from_state_dict(self, state_dict, prefix, *args)  # what it holds as buffers: the bytes
        self._rebuild()


class QuantStateNotBroadcast(_LayerMutant):
    """fsdp_qlora PR 4's class: a layer whose quantization state (absmax, code table) lives
    beside the module, neither parameter nor buffer, so a rank-0 broadcast of the model's state
    (FSDP's sync, a state-dict broadcast) carries the packed bytes and not their scales: the
    other ranks compute with rank 0's codes and their own absmax."""

    name = "mutant-quant-state-not-broadcast"
    catches = "distributed:fsdp"
    suites = DISTRIBUTED_SUITES
    layer_class = _StateOutsideBuffersLinear


MUTANTS = MUTANTS + (LaunchesOnTheCurrentDevice, CachesTheFirstDevice, QuantStateNotBroadcast)


# -- issue 50, item 3: bad data gets a clear answer (suites/test_bad_data.py) ----------------------------------
# The bad-data suite (a ``-k`` name), run against these mutants and the correct backends only.
BAD_DATA_SUITES: tuple[str, ...] = ("test_bad_data.py",)


class QuantizesNaNAsFinite(TorchNF4Backend):
    """A quantizer that sanitizes its input first (``nan_to_num`` before the absmax, as
    code that guards a division writes it): NaN is stored as 0 and inf as the dtype's
    largest value, finite, normal-looking bytes; a diverged weight becomes a healthy one."""

    name = "mutant-quantizes-nan-as-finite"
    catches = "nonfinite-quantize"
    suites = BAD_DATA_SUITES

    def quantize(self, weight, spec):
        return super().quantize(torch.nan_to_num(weight), spec)


class PerBatchActivationScale(TorchNF4Backend):
    """A matmul that scales the whole batch by one power of two from its largest finite |x|
    (a per-tensor dynamic activation scale, as fp8 and int8 kernels compute one, whose max
    skips NaN and inf as a GPU's fmax reduction does), exact for a healthy batch and for a
    NaN row (which stays in its own row): one row of huge finite values underflows every
    other row's result."""

    name = "mutant-per-batch-activation-scale"
    catches = "row-isolation"
    suites = BAD_DATA_SUITES

    def matmul(self, x, q, bias, compute_dtype):
        magnitudes = x.detach().abs()
        largest = torch.where(torch.isfinite(magnitudes), magnitudes, 0).amax().to(compute_dtype)
        scale = torch.exp2(torch.floor(torch.log2(largest.clamp_min(1.0))))  # only ever down: finite, >= 1
        w = self.dequantize(q, compute_dtype)
        y = F.linear(x.to(compute_dtype) / scale, w) * scale
        return (y + bias.to(compute_dtype) if bias is not None else y).to(x.dtype)


class LoadFillsShortStateWithZeros(TorchNF4Backend):
    """A loader that pads a missing or short packed weight or absmax with zeros (and cuts
    a long one to size) instead of refusing: a checkpoint cut short loads, and the lost
    blocks decode to zeros."""

    name = "mutant-load-fills-with-zeros"
    catches = "corrupt-checkpoint"
    suites = BAD_DATA_SUITES

    def load(self, state, device):
        state = dict(state)
        numel = math.prod(int(n) for n in state["shape"]) if "shape" in state else 0
        blocks = -(-numel // int(state.get("blocksize", torch.tensor(64))))
        for key, size, dtype in (("packed", (numel + 1) // 2, torch.uint8), ("absmax", blocks, torch.float32)):
            given = state.get(key, torch.zeros(0, dtype=dtype)).reshape(-1)
            given = given.view(torch.uint8) if key == "packed" else given
            state[key] = torch.cat([given, given.new_zeros(max(0, size - given.numel()))])[:size]
        return super().load(state, device)


MUTANTS = MUTANTS + (QuantizesNaNAsFinite, PerBatchActivationScale, LoadFillsShortStateWithZeros)


# -- issue 50, item 1: provenance (bytes that went wrong between the source and the layer) ---------------------
# The provenance suite (a ``-k`` name), run against these mutants and the correct backend only. Each
# mutant's layer computes right from the bytes it holds (the call-site oracle agrees with it); only
# the bytes' origin is wrong, which only a truth outside the layer (its source checkpoint) shows.
PROVENANCE_SUITES: tuple[str, ...] = ("test_provenance.py",)


class _DeepcopySharesStateLinear(FunctionalLinear):
    def __deepcopy__(self, memo):
        import copy

        for buffer in self._buffers.values():  # "the 4-bit state is frozen: share it, copy the rest"
            if buffer is not None:
                memo[id(buffer)] = buffer
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone

    def _load_from_state_dict(self, state_dict, prefix, *args):
        torch.nn.Module._load_from_state_dict(self, state_dict, prefix, *args)  # in place, as nn.Module loads
        self._rebuild()


class DeepcopySharesQuantState(_LayerMutant):
    """A layer whose ``copy.deepcopy`` shares its quantization buffers with the original
    (frozen bytes, why copy them) and that loads a checkpoint in place, as ``nn.Module``
    does: a DPO reference model made by ``deepcopy``, then another checkpoint loaded into
    it, rewrites the policy's 4-bit weights. Each model computes right from what it holds."""

    name = "mutant-deepcopy-shares-quant-state"
    catches = "provenance"
    suites = PROVENANCE_SUITES
    layer_class = _DeepcopySharesStateLinear


class _ShapeKeyedLoadLinear(FunctionalLinear):
    STAGED = "absmax"  # the buffer (a key of the backend's serialize() dict) the loader stages

    def _load_from_state_dict(self, state_dict, prefix, *args):
        super()._load_from_state_dict(state_dict, prefix, *args)
        # a loader that keys its quant-state staging by tensor shape, not by name: each layer gets
        # the staged buffer of the layer of its shape loaded before it (q_proj's in k_proj)
        name = PREFIX + self.STAGED
        if name not in self._buffers:
            return
        staged = self.backend.__dict__.setdefault(f"staged_{self.STAGED}_by_shape", {})
        key = (self.out_features, self.in_features, tuple(self._buffers[name].shape))
        previous, staged[key] = staged.get(key), self._buffers[name].clone()
        if previous is not None:
            self._buffers[name] = previous.to(self._buffers[name].device)
            self._rebuild()


class LoadTakesNeighbourAbsmax(_LayerMutant):
    """A checkpoint loader whose quant-state staging is keyed by shape: every layer loaded
    after another of its shape decodes its own codes with that neighbour's absmax (finite,
    normal-looking weights of the right scale); the layer checkpoint suites load one layer
    at a time and never see it, and every call agrees with the bytes."""

    name = "mutant-load-takes-neighbour-absmax"
    catches = "provenance"
    suites = PROVENANCE_SUITES
    layer_class = _ShapeKeyedLoadLinear


MUTANTS = MUTANTS + (DeepcopySharesQuantState, LoadTakesNeighbourAbsmax)


# -- issue 50, item 2: comparative accuracy beside the worst-case bound (call level) --------------------------------


class Bf16RunningSumOverLongRows(TorchNF4Backend):
    """A reduced-precision accumulator: the K-tiled kernel this backend takes for rows of 256
    and more keeps its running sum in the compute dtype (bf16 or fp16), adding exact fp32 sums
    of 4 products at a time, as a kernel with a 16-bit accumulator register does. Every
    element stays inside the worst-case bound (``bounds.matmul_bound`` allows every rounding
    to err one way); its error is ~4 times torch's own ``F.linear`` at K = 256, which only the
    comparative check (``reference.comparative``) says."""

    name = "mutant-bf16-running-sum"
    catches = "matmul"
    LONG_ROWS = 256
    TILE = 4

    def matmul(self, x, q, bias, compute_dtype):
        k = x.shape[-1]
        if compute_dtype not in (torch.bfloat16, torch.float16) or k < self.LONG_ROWS or k % self.TILE:
            return super().matmul(x, q, bias, compute_dtype)
        w = self.dequantize(q, compute_dtype)
        tiles = (x.to(compute_dtype).float().unsqueeze(-2) * w.float()).reshape(
            *x.shape[:-1], w.shape[0], -1, self.TILE
        )
        tile_sums = tiles.sum(-1)  # exact fp32 products, each tile summed in fp32
        y = torch.zeros(tile_sums.shape[:-1], dtype=compute_dtype, device=x.device)
        for j in range(tile_sums.shape[-1]):  # the running sum, rounded to the compute dtype at every tile
            y = y + tile_sums[..., j].to(compute_dtype)
        return (y + bias.to(compute_dtype) if bias is not None else y).to(x.dtype)


MUTANTS = MUTANTS + (Bf16RunningSumOverLongRows,)


# -- issue 50, at the model level: a tensor that is not a 4-bit layer, loaded wrong ----------------------------
# Only the truths from outside the layers see it: every 4-bit call is right against its own bytes. The
# workloads end with provenance (the lm_head is not its source's) and then the model replay (the logits
# against a float64 replay of the layers' own bytes and the source checkpoint's other tensors); each
# alone catches it (tests/test_provenance_check.py, tests/test_workload_checks.py).


class QuantizedLoadLeavesLmHeadUntied(LibraryMutant):
    """transformers#43429's class (Ministral-3 generated gibberish: its tied-weights mapping was
    empty, so the checkpoint's missing ``lm_head.weight`` was initialized afresh instead of tied
    to the embedding), planted into transformers for loads with a quantization config: GPT-2's
    lm_head is left at a random initialization. Every 4-bit layer computes right from its
    bytes, the logits are finite, a QLoRA step trains its adapters right; the model's output
    is noise."""

    name = "mutant-lib-quantized-load-unties-lm-head"
    catches = "workload:qlora-step"
    selection = "test_qlora_training_step and gpt2"
    expect = r"lm_head\.weight: differs from the source|model replay: the quantized model's logits err"

    @staticmethod
    def plant() -> None:
        import transformers

        original = transformers.PreTrainedModel.get_expanded_tied_weights_keys

        def get_expanded_tied_weights_keys(self, *args, **kwargs):
            if getattr(self.config, "quantization_config", None) is not None:
                return {}
            return original(self, *args, **kwargs)

        transformers.PreTrainedModel.get_expanded_tied_weights_keys = get_expanded_tied_weights_keys


LIBRARY_MUTANTS = LIBRARY_MUTANTS + (QuantizedLoadLeavesLmHeadUntied,)


# -- issue 51, item 1: state kept across phases (suites/test_workload_loops.py, the loop state machine) ----------
# The loop suite (a ``-k`` name), run against these mutants and the correct backend only: each of its
# instances draws sequences of serving, training, checkpoint and weight-sync steps on a whole model.
LOOP_SUITES: tuple[str, ...] = ("test_workload_loops.py",)


class _CachesEvalWeightLinear(FunctionalLinear):
    def forward(self, x):
        if self.training or torch.is_grad_enabled():
            return super().forward(x)
        # "the weight is frozen in inference": dequantized once, at the first eval call without grad
        cached = self.__dict__.get("eval_weight")
        if cached is None:
            with torch.inference_mode(False), torch.no_grad():
                cached = self.__dict__["eval_weight"] = self.backend.dequantize(self.quantized, self.compute_dtype)
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return F.linear(x.to(self.compute_dtype), cached, bias).to(x.dtype)


class EvalWeightKeptAcrossPhases(_LayerMutant):
    """A layer whose inference path (eval mode, no grad or inference mode) dequantizes its
    weight once, at its first such call, and reuses it from then on: right in every single
    phase (a generate, a serving session, a training step, a save and load each start from
    a fresh layer), wrong in a loop that serves, then loads new weights into the same model
    (an RL trainer's weight sync, a resume into the running model, a merge) and serves
    again: it serves the old policy."""

    name = "mutant-eval-weight-kept-across-phases"
    catches = "workload:loop"
    suites = LOOP_SUITES
    layer_class = _CachesEvalWeightLinear


MUTANTS = MUTANTS + (EvalWeightKeptAcrossPhases,)


# -- Issue 51: settings as axes ---------------------------------------------------------------------------------
# Bugs of a setting users pass (the packed storage dtype, an argument form of the call) on one route only: the
# checks that take the setting at fixed rows (the storage and parameter suites) pass them, and so does the
# route check with the setting's axis held at its default (``held_at_default``, a ``-k`` expression that keeps
# the checks of ``missed_by`` and drops the route check's instances of the other values: tests/test_mutant_zoo.py
# runs it and requires every cell to pass). With the setting an axis of the route check, every pair of its
# values with a route is an instance, and the route's cell fails. In the original run.


class GemmRouteReadsStorageWords(TorchNF4Backend):
    """A GEMM route (declared from 9 rows: ``dispatch_rows``) whose dequantize loads the packed
    weight in words of its storage dtype and takes each word's bytes most significant first:
    for uint8 storage the same bytes, for the bf16, fp16 or fp32 storage of FSDP-QLoRA every
    word's bytes reversed, so codes land on their neighbours. The storage suite multiplies at
    1 and 5 rows (the gemv), and the route check stored every weight as uint8 before the storage
    dtype became one of its axes."""

    name = "mutant-gemm-route-storage-words"
    catches = "matmul"
    ROWS = 9
    missed_by = ("storage", "matmul")
    held_at_default = "test_storage.py or (test_matmul_every_route and not -sbf16 and not -sfp16 and not -sfp32)"

    def capabilities(self, device):
        return dataclasses.replace(super().capabilities(device), dispatch_rows=(self.ROWS,))

    def matmul_with(self, x, q, bias, compute_dtype, *, out=None, orientation="default"):
        packed = q.handle["packed"]
        if math.prod(x.shape[:-1]) >= self.ROWS and packed.dtype is not torch.uint8:
            words = packed.view(torch.uint8).reshape(-1, packed.element_size()).flip(-1)
            q = dataclasses.replace(q, handle={**q.handle, "packed": words.reshape(-1).view(packed.dtype)})
        return super().matmul_with(x, q, bias, compute_dtype, out=out, orientation=orientation)


class OutGemvStoresEachSplit(TorchNF4Backend):
    """A one-row gemv (declared: ``dispatch_rows`` 2, a GEMM from two rows) that splits K into
    chunks of 128, each chunk's partial sums reduced in a workspace of its own for the plain
    call, but stored straight into the caller's ``out=`` buffer (a store where an add was
    meant): the last chunk wins. With one chunk (K <= 128) it is right, and the parameter
    suite hands ``out=`` one row on weights of K = 128 and 64 only; the route check's weight
    (K = 256 on a CPU, 1024 on a GPU) met ``out=`` at no row count before the argument form
    became one of its axes."""

    name = "mutant-out-gemv-split-k"
    catches = "matmul"
    SPLIT = 128
    missed_by = ("parameters", "matmul")
    held_at_default = "test_parameters.py or (test_matmul_every_route and not call-out)"

    def capabilities(self, device):
        return dataclasses.replace(super().capabilities(device), dispatch_rows=(2,))

    def matmul_with(self, x, q, bias, compute_dtype, *, out=None, orientation="default"):
        if out is None or math.prod(x.shape[:-1]) != 1:
            return super().matmul_with(x, q, bias, compute_dtype, out=out, orientation=orientation)
        w = self.dequantize(q, compute_dtype)
        row, flat = x.to(compute_dtype).reshape(1, -1), out.view(1, -1)
        b = bias.to(compute_dtype) if bias is not None else None
        k = row.shape[-1]
        for start in range(0, k, self.SPLIT):
            end = start + self.SPLIT
            flat.copy_(F.linear(row[:, start:end], w[:, start:end], b if end >= k else None))  # the epilogue adds b
        return out


class AsQuantizedBackwardReadsTransposed(TorchNF4Backend):
    """A backend documenting two orientations of its packed weight, as bitsandbytes'
    ``matmul_4bit`` does (the weight transposed, as ``Linear4bit`` hands it over, and as
    ``quantize_4bit`` returned it), whose forward takes either right, but whose backward for the
    as-quantized one from 16 rows on (a GEMM route, where fewer rows take a gemv) reads the
    dequantized (N, K) weight as a (K, N) one: the gradient of x is multiplied by a scrambled
    weight of the right shape. The parameter suite's orientation check runs forward and backward
    at 1 and 5 rows only, the route check's ``call_form`` forward only: both pass it, and so does
    the gradient check (1, 128 and 300 rows) until the orientation became one of its axes."""

    name = "mutant-as-quantized-backward-transposed"
    catches = "backward"
    ROWS = 16
    missed_by = ("parameters", "matmul", "backward")
    held_at_default = (
        "test_parameters.py or test_matmul_every_route or (test_gradients_match_reference and not orient-as-quantized)"
    )

    def capabilities(self, device):
        return dataclasses.replace(super().capabilities(device), weight_orientations=("default", "as-quantized"))

    def matmul_with(self, x, q, bias, compute_dtype, *, out=None, orientation="default"):
        y = super().matmul_with(x, q, bias, compute_dtype, out=out)  # the forward: right in either orientation
        if orientation == "default" or out is not None or not torch.is_grad_enabled() or _rows_of(x) < self.ROWS:
            return y
        n, k = q.shape
        scrambled = self.dequantize(q, compute_dtype).reshape(k, n).T
        b = bias.to(compute_dtype) if bias is not None else None
        wrong = F.linear(x.to(compute_dtype), scrambled, b)
        return y.detach() + (wrong - wrong.detach()).to(y.dtype)  # y's value, the scrambled weight's gradient


class _ShapeKeyedNestedLoadLinear(_ShapeKeyedLoadLinear):
    STAGED = "nested_absmax"  # double quantization's per-group scale of the 8-bit absmax codes


class LoadTakesNeighbourNestedAbsmax(_LayerMutant):
    """The shape-keyed loader of ``LoadTakesNeighbourAbsmax``, wrong for double-quantized layers
    only: each layer loaded after another of its shape decodes its absmax codes with that
    neighbour's nested absmax (its groups' scales). Provenance refused every double-quantized
    layer that was not bit-equal to saved bytes, so it ran none; with ``double_quant`` as its
    axis it traces the nested absmax to the source's block maxima."""

    name = "mutant-load-takes-neighbour-nested-absmax"
    catches = "provenance"
    suites = PROVENANCE_SUITES
    layer_class = _ShapeKeyedNestedLoadLinear
    missed_by = ("provenance",)
    held_at_default = "test_provenance.py and not -dq-"


SETTING_MUTANTS: tuple[type[Backend], ...] = (
    GemmRouteReadsStorageWords,
    OutGemvStoresEachSplit,
    AsQuantizedBackwardReadsTransposed,
    LoadTakesNeighbourNestedAbsmax,
)
MUTANTS = MUTANTS + SETTING_MUTANTS


# -- Issue 51: sizes -----------------------------------------------------------------------------------------------
# Bugs at sizes real runs reach and no drawn, listed or declared shape does: a library's tier at row counts its
# adapter does not declare, a grid dimension capped at 65535, an index held in a type too narrow for the
# activation's elements. The rows ladder (``axes.ROWS_LADDER``: its checks are ``SIZE_SUITES``; the rungs above
# 2^12 + 1 are large on a CPU, so the zoo's run of them passes --qconform-large) catches each; the matmul suite
# without the ladder passes each, every cell (tests/test_mutant_zoo.py, ``SIZE_MISSED_WITHOUT``).
# On a GPU, the matmul and backward of 65536 rows at K = 14336 in one call too (``large`` there, not claimed on a
# CPU).
SIZE_SUITES: tuple[str, ...] = (
    "test_matmul_rows_ladder",
    "test_backward_rows_ladder",
    "test_dequantize_real_sizes",
    "test_matmul_prefill_at_long_k",
    "test_backward_prefill_at_long_k",
)


def _rows_of(x: torch.Tensor) -> int:
    return math.prod(x.shape[:-1])


class UndeclaredRowTier(TorchNF4Backend):
    """A batch tier the library takes from 2049 to 4096 rows, declared nowhere (as
    bitsandbytes' batch tiers and ROCm's GEMM paths are not), that computes whole tiles of 64
    rows and never stores a partial last tile: 2049 rows lose their last row, 4095 their last
    63. The declared-routes rows axis (1, 128 and 300 for this backend, which declares no
    route), the drawn rows (at most 40) and the layer shapes' (at most 64) never reach the
    tier; the ladder's 2049 and 4095 do, in the default run."""

    name = "mutant-undeclared-row-tier"
    catches = "matmul"
    suites = SIZE_SUITES
    TIER = (2049, 4096)
    TILE = 64

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        rows = _rows_of(x)
        if not self.TIER[0] <= rows <= self.TIER[1] or rows % self.TILE == 0:
            return y
        flat = y.reshape(rows, -1).clone()
        flat[rows - rows % self.TILE :] = 0  # the partial last tile, never stored
        return flat.reshape(y.shape)


class RowsPastGridLimit(TorchNF4Backend):
    """A kernel launched with one program per activation row on a grid dimension that CUDA
    caps at 65535 (y and z): the rows from the 65536th on are never computed (left zero). A
    QLoRA batch of 8 x 8192 tokens is 65536 rows in one call; the ladder's 65536 and 65537
    reach it (the top of the ladder: large on a CPU), nothing below them does."""

    name = "mutant-rows-past-grid-limit"
    catches = "matmul"
    suites = SIZE_SUITES
    GRID_LIMIT = 65535

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        rows = _rows_of(x)
        if rows <= self.GRID_LIMIT:
            return y
        flat = y.reshape(rows, -1).clone()
        flat[self.GRID_LIMIT :] = 0
        return flat.reshape(y.shape)


class ActivationOffsetsInFloat32(TorchNF4Backend):
    """A kernel that computes its offsets into x (``row * K + k``) in float32, whose integers
    are exact only up to 2^24: past 16,777,216 elements an offset rounds to an even one, and
    an odd element is read from its neighbour (the index-width class of a 2^31-element weight,
    at a width the CPU reaches). The ladder's 65537 rows of K = 256 pass 2^24 elements by one
    row; 65536 rows, exactly 2^24, do not."""

    name = "mutant-activation-offsets-fp32"
    catches = "matmul"
    suites = SIZE_SUITES
    EXACT_UP_TO = 1 << 24

    def matmul(self, x, q, bias, compute_dtype):
        if x.numel() <= self.EXACT_UP_TO:
            return super().matmul(x, q, bias, compute_dtype)
        flat = x.contiguous().reshape(-1)
        offsets = torch.arange(flat.numel(), device=x.device).to(torch.float32).to(torch.int64)
        read = flat[offsets.clamp_(max=flat.numel() - 1)].reshape(x.shape)
        return super().matmul(read, q, bias, compute_dtype)


class SplitTierPast2To29(TorchNF4Backend):
    """The base of the two tier mutants: a path taken once the activation passes 2^29
    elements (a tier chosen by the problem's size, as kernels bound by a workspace choose
    one), split in four along one dimension, whose last split is left out. 65536 rows at
    K = 14336 (a QLoRA batch through an MLP's down projection: 9.4 x 10^8 elements) reach
    it; the ladder's top (65537 x 256) and the long K (300 x 14336) stay far below, as does
    every other check. Only the 65,536-row checks catch them, a GPU's (their float64
    activation)."""

    suites = SIZE_SUITES
    needs_gpu = True
    TIER = 1 << 29
    SPLITS = 4

    def past_tier(self, x: torch.Tensor) -> bool:
        return x.numel() > self.TIER

    def kept(self, width: int) -> int:
        """The elements of a dimension of ``width`` before its last split."""
        return width - width // self.SPLITS


class ActivationTierDropsLastSplit(SplitTierPast2To29):
    """A matmul whose split-K sum past the tier leaves out the last of its four K splits:
    caught by ``test_matmul_prefill_at_long_k`` alone."""

    name = "mutant-activation-tier-drops-split"
    catches = "matmul"

    def matmul(self, x, q, bias, compute_dtype):
        if not self.past_tier(x):
            return super().matmul(x, q, bias, compute_dtype)
        cut = x.clone()
        cut[..., self.kept(x.shape[-1]) :] = 0
        return super().matmul(cut, q, bias, compute_dtype)


class GradientTierDropsLastSplit(SplitTierPast2To29):
    """A backward whose dx (``dy W``, summed over the output features) past the tier leaves
    out the last of its four splits of them: dx misses those features' part, and so does
    the bias' gradient; the forward is right. Caught by ``test_backward_prefill_at_long_k``
    alone."""

    name = "mutant-gradient-tier-drops-split"
    catches = "backward"

    def matmul(self, x, q, bias, compute_dtype):
        y = super().matmul(x, q, bias, compute_dtype)
        if not self.past_tier(x) or not y.requires_grad:
            return y
        kept = self.kept(y.shape[-1])

        def drop_last_split(dy):
            dy[..., kept:] = 0
            return dy

        return gradient_altered(y, drop_last_split)


SIZE_MUTANTS: tuple[type[Backend], ...] = (
    UndeclaredRowTier,
    RowsPastGridLimit,
    ActivationOffsetsInFloat32,
    ActivationTierDropsLastSplit,
    GradientTierDropsLastSplit,
)
MUTANTS = MUTANTS + SIZE_MUTANTS


class QuantizeNeighbourCodePast2To20(TorchNF4Backend):
    """A quantizer whose second pass (elements past 2^20, a kernel's second launch over a
    large weight) takes, for values of small magnitude (scaled below 0.3, where the codes lie
    close together), the second-nearest code: a neighbour, one narrow gap away. Its bytes
    decode consistently, and every decoded value stays within the faithfulness check's bound
    (half the format's widest gap: ``reference.faithful``) of its input; only the codes
    against the reference quantizer see it, at a real width (151936 x 64: 9.7 M elements),
    which ``test_dequantize_real_sizes`` quantizes and checks against its source weight."""

    name = "mutant-quantize-neighbour-code-past-2-20"
    catches = "dequantize"
    suites = SIZE_SUITES
    zoo_max_out_features = None  # the zoo narrows widths; this class lives at the widest
    WRAP = 1 << 20

    def quantize_codes(self, flat, absmax, blocksize, table):
        codes = super().quantize_codes(flat, absmax, blocksize, table)
        if flat.numel() <= self.WRAP:
            return codes
        tail, tail_codes = flat[self.WRAP :], codes[self.WRAP :]
        scale = absmax.repeat_interleave(blocksize)[self.WRAP : flat.numel()]
        scaled = torch.where(scale > 0, tail / scale, torch.zeros_like(tail))
        distance = (scaled.unsqueeze(-1) - table).abs()
        distance.scatter_(-1, tail_codes.long().unsqueeze(-1), float("inf"))
        second = distance.argmin(-1).to(codes.dtype)
        codes[self.WRAP :] = torch.where(scaled.abs() < 0.3, second, tail_codes)
        return codes


MUTANTS = MUTANTS + (QuantizeNeighbourCodePast2To20,)

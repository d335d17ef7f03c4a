"""The call-site oracle: every call of a quantized layer inside a real workload, judged.

A check that calls one operation the way a test writes it misses the settings real code
creates (no grad, inference mode, autocast, recomputation under gradient checkpointing,
3-D views, a new row count at every generated token). The oracle sits on the layers
instead: PyTorch forward hooks and full backward hooks on every module a backend's layer
facet owns (bitsandbytes' ``Linear4bit``, HQQ's ``HQQLinear``, ``FunctionalLinear``)
see each forward ``y = layer(x)`` and each backward ``dx`` for ``dy``, and each sampled
call is compared with the float64 reference of that layer's own stored bytes *as they
are at that moment* (``LayerFacet.packed``), under the bounds the suites derive
(``bounds.matmul_bound`` and ``bounds.grad_bound`` with ``bounds.layer_weight_error``).

The hooks look only: they return nothing, so the library computes on exactly the tensors
the model passes (a full backward hook hands the module an autograd alias of its input:
the same memory, strides, offset and dtype).

Beyond the numbers, each call's contract: the output's shape ``(*x.shape[:-1], N)``, its
device (the input's) and its dtype (the input's; under autocast the autocast dtype is
also allowed), and stored bytes that decode to finite values. Never both sides wrong: a
layer whose stored state decodes to NaN or inf fails even where its output agrees.

Sampling bounds the cost: per layer and context signature (``CallContext.signature``),
the first ``first_calls`` calls, plus every call of a row count that layer had not been
called with. Every call is counted; ``summary`` says how many were seen and judged.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pytest_qconform.backends.layers import LayerFacet
from pytest_qconform.reference import bounds, faithful, linear
from pytest_qconform.watch.context import CallContext

FIRST_CALLS = 2  # judged calls per layer and context signature (every new row count besides)


@dataclass(frozen=True)
class CallVerdict:
    """One judged call: which layer, which of its calls, in what context, and the result."""

    layer: str
    backend: str
    call: int  # the layer's call number in its direction (forward or backward), from 1
    context: CallContext
    multiple: float  # worst error as a multiple of its bound (inf: a contract or finiteness failure)
    message: str = ""  # why it failed; empty when it passed

    @property
    def passed(self) -> bool:
        return not self.message

    def describe(self) -> str:
        rows = f"{self.context.rows} rows"
        return f"{self.layer} [{self.backend}] {self.context.direction} call {self.call} ({rows}; {self.context.signature()})"


@dataclass
class _Watched:
    name: str
    backend: str
    facet: LayerFacet
    forward_calls: int = 0
    backward_calls: int = 0
    forward_dtype: torch.dtype | None = None  # the last grad-recording forward's compute dtype, for its backward


@dataclass
class _Decoded:
    weight: torch.Tensor  # float64 (N, K) on the call's device
    finite: bool
    errors: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # layer_weight_error per compute dtype


def _fingerprint(packed: Any) -> str:
    """A digest of every field of a packed record (bytes, scales, tables, sizes)."""
    digest = hashlib.blake2b(digest_size=16)
    for key, value in sorted(vars(packed).items()):
        digest.update(key.encode())
        if hasattr(value, "tobytes"):
            digest.update(str(getattr(value, "dtype", "")).encode() + str(getattr(value, "shape", "")).encode())
            digest.update(value.tobytes())
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _coarser(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with the larger unit roundoff (fewer significand bits)."""
    return a if bounds.unit_roundoff(a) >= bounds.unit_roundoff(b) else b


def _rounded_through(bound: torch.Tensor, exact: torch.Tensor, compute: torch.dtype, out: torch.dtype) -> torch.Tensor:
    """A result computed in a dtype coarser than the one it is returned in (a bf16 layer
    handed fp32 activations casts its result back) was rounded to the compute dtype on
    the way: one more rounding, subnormal spacing included."""
    if compute == out or bounds.unit_roundoff(compute) <= bounds.unit_roundoff(out):
        return bound
    return bound + bounds.rounding_bound(exact.abs() + bound, compute)


class CallOracle:
    """Hooks on every quantized layer of the models it is attached to, and the verdicts."""

    def __init__(self, facets: Mapping[str, LayerFacet], *, first_calls: int = FIRST_CALLS) -> None:
        self.facets = dict(facets)  # backend name -> its layer facet
        self.first_calls = first_calls
        self.verdicts: list[CallVerdict] = []
        self.seen: Counter[tuple[str, str]] = Counter()  # (backend, signature) -> calls made
        self.judged: Counter[tuple[str, str]] = Counter()  # (backend, signature) -> calls judged
        self._watched: dict[int, _Watched] = {}
        self._handles: list[Any] = []
        self._per_signature: Counter[tuple[int, str]] = Counter()
        self._row_counts: set[tuple[int, str, int]] = set()
        self._decoded: dict[tuple[str, str], _Decoded] = {}

    # -- attaching --------------------------------------------------------------------------------

    def facet_of(self, module: torch.nn.Module) -> tuple[str, LayerFacet] | None:
        return next(((name, facet) for name, facet in self.facets.items() if facet.owns(module)), None)

    def attach(self, model: torch.nn.Module) -> int:
        """Hook every quantized layer of ``model`` not hooked yet; returns how many are watched now."""
        for name, module in model.named_modules():
            if id(module) in self._watched:
                continue
            owner = self.facet_of(module)
            if owner is None:
                continue
            self._watched[id(module)] = _Watched(name or type(module).__name__, *owner)
            self._handles.append(module.register_forward_hook(self._on_forward))
            self._handles.append(module.register_full_backward_hook(self._on_backward))
        return len(self._watched)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # -- sampling ---------------------------------------------------------------------------------

    def _sampled(self, module: torch.nn.Module, watched: _Watched, context: CallContext) -> bool:
        backend = watched.backend
        signature = context.signature()
        self.seen[(backend, signature)] += 1
        self._per_signature[(id(module), signature)] += 1
        shape = (id(module), context.direction, context.rows)
        new_rows = shape not in self._row_counts
        self._row_counts.add(shape)
        judge = new_rows or self._per_signature[(id(module), signature)] <= self.first_calls
        if judge:
            self.judged[(backend, signature)] += 1
        return judge

    # -- hooks ------------------------------------------------------------------------------------

    @torch._dynamo.disable
    def _on_forward(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        watched = self._watched.get(id(module))
        if watched is None or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        watched.forward_calls += 1
        context = CallContext.of_forward(x)
        compute = self._compute_dtype(watched.facet, module, x, context)
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            watched.forward_dtype = compute
        if not self._sampled(module, watched, context):
            return
        with torch.no_grad():
            self._record(
                watched,
                watched.forward_calls,
                context,
                lambda: self._judge_forward(watched, module, x, output, compute, context),
            )

    @torch._dynamo.disable
    def _on_backward(self, module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        watched = self._watched.get(id(module))
        if watched is None or not grad_output or grad_output[0] is None:
            return
        dx = grad_input[0] if grad_input else None
        if dx is None:
            return  # the input needs no gradient: the library computes none, nothing to judge
        dy = grad_output[0]
        watched.backward_calls += 1
        context = CallContext.of_backward(dy)
        if not self._sampled(module, watched, context):
            return
        compute = watched.forward_dtype or dy.dtype
        with torch.no_grad():
            self._record(
                watched, watched.backward_calls, context, lambda: self._judge_backward(watched, module, dy, dx, compute)
            )

    def _record(self, watched: _Watched, call: int, context: CallContext, judge: Any) -> None:
        try:
            multiple, message = judge()
        except Exception as exc:  # noqa: BLE001 - a call the oracle cannot judge is a failed call, named
            multiple, message = math.inf, f"the oracle could not judge this call: {type(exc).__name__}: {exc}"
        self.verdicts.append(CallVerdict(watched.name, watched.backend, call, context, multiple, message))

    # -- judging ----------------------------------------------------------------------------------

    def _compute_dtype(
        self, facet: LayerFacet, module: torch.nn.Module, x: torch.Tensor, context: CallContext
    ) -> torch.dtype:
        """The dtype the layer's product is computed in: its compute dtype (the input's when
        it has none), or, under autocast, the coarser of that and the autocast dtype."""
        compute = facet.compute_dtype(module) or x.dtype
        if context.autocast != "off" and x.is_floating_point():
            compute = _coarser(compute, torch.get_autocast_dtype(x.device.type))
        return compute

    def _decode(self, facet: LayerFacet, module: torch.nn.Module, device: torch.device) -> tuple[Any, _Decoded]:
        packed = facet.computing_state(module)
        key = (_fingerprint(packed), str(device))
        decoded = self._decoded.get(key)
        if decoded is None:
            weight = faithful.decode(packed, device)
            decoded = self._decoded[key] = _Decoded(weight, bool(torch.isfinite(weight).all()))
        return packed, decoded

    def _weight_error(
        self, packed: Any, decoded: _Decoded, layer_dtype: torch.dtype, compute: torch.dtype
    ) -> torch.Tensor:
        if layer_dtype not in decoded.errors:
            decoded.errors[layer_dtype] = bounds.layer_weight_error(packed, decoded.weight, layer_dtype)
        error = decoded.errors[layer_dtype]
        if compute != layer_dtype:  # autocast rounds the dequantized weight once more
            error = error + bounds.rounding_bound(decoded.weight.abs() + error, compute)
        return error

    def _judge_forward(
        self,
        watched: _Watched,
        module: torch.nn.Module,
        x: torch.Tensor,
        y: Any,
        compute: torch.dtype,
        context: CallContext,
    ) -> tuple[float, str]:
        facet = watched.facet
        packed, decoded = self._decode(facet, module, x.device)
        n, k = decoded.weight.shape
        if not decoded.finite:
            return math.inf, "the layer's stored state decodes to NaN or inf (never both sides wrong)"
        if not isinstance(y, torch.Tensor):
            return math.inf, f"the layer returned {type(y).__name__}, not a tensor"
        problems = []
        if tuple(y.shape) != (*x.shape[:-1], n):
            problems.append(f"output shape {tuple(y.shape)}, expected {(*x.shape[:-1], n)}")
        if y.device != x.device:
            problems.append(f"output on {y.device}, the input on {x.device}")
        allowed = {x.dtype} | ({torch.get_autocast_dtype(x.device.type)} if context.autocast != "off" else set())
        if y.dtype not in allowed:
            problems.append(f"output dtype {y.dtype}, expected {' or '.join(sorted(map(str, allowed)))}")
        if problems:
            return math.inf, "; ".join(problems)
        layer_dtype = facet.compute_dtype(module) or x.dtype
        w = decoded.weight
        bias = facet.bias(module)
        b64 = bias.detach().double().to(x.device) if bias is not None else None
        x64 = x.detach().double()
        exact = linear.linear(x64, w, b64)
        bound = bounds.matmul_bound(
            x64,
            w,
            b64,
            compute,
            y.dtype,
            w_error=self._weight_error(packed, decoded, layer_dtype, compute),
            exact=exact,
        )
        return self._compare(y, exact, _rounded_through(bound, exact, compute, y.dtype), "forward")

    def _judge_backward(
        self, watched: _Watched, module: torch.nn.Module, dy: torch.Tensor, dx: torch.Tensor, compute: torch.dtype
    ) -> tuple[float, str]:
        facet = watched.facet
        packed, decoded = self._decode(facet, module, dy.device)
        if not decoded.finite:
            return math.inf, "the layer's stored state decodes to NaN or inf (never both sides wrong)"
        w = decoded.weight
        expected_shape = (*dy.shape[:-1], w.shape[1])
        if tuple(dx.shape) != expected_shape:
            return math.inf, f"input gradient shape {tuple(dx.shape)}, expected {expected_shape}"
        layer_dtype = facet.compute_dtype(module) or dx.dtype
        dy64 = dy.detach().double()
        exact = dy64 @ w
        bound = bounds.grad_bound(
            dy64, w, compute, dx.dtype, w_error=self._weight_error(packed, decoded, layer_dtype, compute)
        )
        return self._compare(dx, exact, _rounded_through(bound, exact, compute, dx.dtype), "dx = dy W")

    @staticmethod
    def _compare(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> tuple[float, str]:
        """Judged where the reference is finite (an input that is already NaN or inf, from an
        earlier layer, has no finite answer here; that earlier layer is where it failed)."""
        finite = torch.isfinite(exact)
        multiple = bounds.error_multiple(actual[finite], exact[finite], bound[finite])
        if multiple <= 1.0:
            return multiple, ""
        diff = (actual.double() - exact).abs()
        ratio = torch.where(finite, diff / bound.clamp_min(1e-300), torch.zeros_like(diff)).nan_to_num(nan=math.inf)
        flat = int(torch.argmax(ratio.reshape(-1)).item())
        return multiple, (
            f"{what}: error is {multiple:.3g} x its bound (worst element flat index {flat}: got "
            f"{actual.reshape(-1)[flat].item()!r}, reference {exact.reshape(-1)[flat].item()!r}, "
            f"bound {bound.reshape(-1)[flat].item():.3g})"
        )

    # -- results ----------------------------------------------------------------------------------

    @property
    def failures(self) -> list[CallVerdict]:
        return [v for v in self.verdicts if not v.passed]

    @property
    def worst_multiple(self) -> float | None:
        return max((v.multiple for v in self.verdicts), default=None)

    @property
    def layers(self) -> int:
        return len(self._watched)

    def summary(self) -> dict[str, Any]:
        """Per backend: calls seen and judged, failed, and the judged calls per context signature."""
        backends = sorted({b for b, _ in self.seen})
        return {
            backend: {
                "seen": sum(n for (b, _), n in self.seen.items() if b == backend),
                "judged": sum(n for (b, _), n in self.judged.items() if b == backend),
                "failed": sum(1 for v in self.failures if v.backend == backend),
                "contexts": {s: n for (b, s), n in sorted(self.judged.items()) if b == backend},
            }
            for backend in backends
        }

    def failure_report(self, limit: int = 5) -> str:
        failed = self.failures
        lines = [f"{len(failed)} of {len(self.verdicts)} judged calls failed:"]
        lines += [f"  {v.describe()}: {v.message}" for v in failed[:limit]]
        if len(failed) > limit:
            lines.append(f"  ... and {len(failed) - limit} more")
        return "\n".join(lines)

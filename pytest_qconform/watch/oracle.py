"""The call-site oracle: every call of a quantized layer inside a real workload, judged.

A check that calls one operation the way a test writes it misses the settings real code
creates (no grad, inference mode, autocast, recomputation under gradient checkpointing,
3-D views, a new row count at every generated token). The oracle sits on the layers
instead: PyTorch forward hooks and backward hooks on every module a backend's layer
facet owns (bitsandbytes' ``Linear4bit``, HQQ's ``HQQLinear``, ``FunctionalLinear``)
see each forward ``y = layer(x)`` and each backward ``dx`` for ``dy``, and each sampled
call is compared with the float64 reference of that layer's own stored bytes *as they
are at that moment* (``LayerFacet.packed``), under the bounds the suites derive
(``bounds.matmul_bound`` and ``bounds.grad_bound`` with ``bounds.layer_weight_error``).

The hooks look only: the library computes on exactly the tensors the model passes. (An
eager call that records a graph gets autograd aliases of its input and output, as a full
backward hook gives them: the same memory, strides, offset and dtype.)

Beside the worst-case bound, a second truth: torch's own dense op (``F.linear`` for the
forward, ``matmul`` for ``dx = dy W``) on the same decoded weight in the same dtypes, run
on the call's device under ``no_grad`` on copies (the library's tensors are only read). A
call within its bound whose error is more than ``comparative.COMPARATIVE_FACTOR`` times
torch's at the 90th percentile fails with its own message (``reference.comparative``: the
statistic, its factor and why; a call of fewer than ``MIN_ELEMENTS`` outputs is not
compared). Each verdict carries its ratio; ``worst_comparative`` goes into the cell.

Beyond the numbers, each call's contract: the output's shape ``(*x.shape[:-1], N)``, its
device (the input's) and its dtype (the input's; under autocast the autocast dtype is
also allowed), and stored bytes that decode to finite values. Never both sides wrong: a
layer whose stored state decodes to NaN or inf fails even where its output agrees.

Compiled and captured calls. Inside a ``torch.compile``d model dynamo traces the forward
hook too: there it only appends the layer's input and output to a queue (dynamo makes
them outputs of its graph and replays the append after the graph runs), so the compiled
program keeps its one graph, its fusions and its CUDA graphs. ``settle()`` judges the
queued calls as compiled calls; the watch calls it when it ends, and every eager call
of a watched layer first. Under ``mode="reduce-overhead"`` a graph's outputs live until
its next replay: call ``settle()`` after each compiled step (a queued output that a
replay overwrote fails, saying so). A call made while a CUDA graph is being captured
has no values yet: it is recorded with its tensors, which the graph replays into, and
judged by ``settle()`` on the values of the graph's last replay.

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
from torch.utils.hooks import BackwardHook

from pytest_qconform.backends.layers import LayerFacet
from pytest_qconform.reference import bounds, comparative, faithful, linear
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
    comparative: float | None = None  # its error over torch's dense op's (reference.comparative); None: not compared

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
    module: torch.nn.Module
    backward: BackwardHook | None = None  # the eager call under way's backward hook (see _backward_pre_hook)
    forward_calls: int = 0
    backward_calls: int = 0
    forward_dtype: torch.dtype | None = None  # the last grad-recording forward's compute dtype, for its backward


@dataclass
class _Decoded:
    weight: torch.Tensor  # float64 (N, K) on the call's device
    finite: bool
    errors: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # layer_weight_error per compute dtype
    decode_errors: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)  # weight_error per compute dtype


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
        self._pending: list[tuple[_Watched, int, CallContext, Any]] = []  # captured calls, judged by settle()
        self._compiled: list[tuple[Any, ...]] = []  # compiled calls' (watched, x, y, settings), judged by settle()

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
            watched = self._watched[id(module)] = _Watched(name or type(module).__name__, *owner, module)
            self._handles.append(module.register_forward_hook(self._forward_hook(watched)))
            self._handles.append(module.register_forward_pre_hook(self._backward_pre_hook(watched)))
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

    def _forward_hook(self, watched: _Watched) -> Any:
        """The forward hook of one layer. Traced by dynamo inside a compiled model, where it
        only queues the call (the tensors and the modes it ran under); eager, it judges."""
        queue = self._compiled

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            if torch.compiler.is_compiling():
                if args and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor):
                    x = args[0]
                    kind = x.device.type
                    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
                    queue.append((watched, x, output, torch.is_grad_enabled(), autocast))  # inference mode: y's
                return None
            self._on_forward(module, watched, args, output)
            backward, watched.backward = watched.backward, None
            return None if backward is None else backward.setup_output_hook(output)

        return hook

    def _backward_pre_hook(self, watched: _Watched) -> Any:
        """What ``register_full_backward_hook`` does, done by the watch itself and only for
        an eager call that records a graph: PyTorch's ``BackwardHook`` hands the module an
        autograd alias of its input (the same memory, strides, offset and dtype) and of its
        output, and reports ``dx`` for ``dy`` of this call. A module with a full backward
        hook registered is one dynamo refuses to compile (it runs it eagerly), so a watched
        model compiles as the unwatched one does."""

        def pre_hook(module: torch.nn.Module, args: tuple) -> Any:
            if torch.compiler.is_compiling() or not torch.is_grad_enabled():
                return None
            watched.backward = BackwardHook(module, [self._on_backward], [])
            return watched.backward.setup_input_hook(args)

        return pre_hook

    @torch._dynamo.disable
    def _on_forward(self, module: torch.nn.Module, watched: _Watched, args: tuple, output: Any) -> None:
        self._judge_compiled()
        if not args or not isinstance(args[0], torch.Tensor):
            return
        self._forward_call(module, watched, args[0], output, CallContext.of_forward(args[0]))

    def _forward_call(
        self, module: torch.nn.Module, watched: _Watched, x: torch.Tensor, output: Any, context: CallContext
    ) -> None:
        watched.forward_calls += 1
        compute = self._compute_dtype(watched.facet, module, x, context)
        if context.grad and isinstance(output, torch.Tensor) and output.requires_grad:
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
        if context.captured:  # recorded, not run: its values exist after a replay
            self._pending.append((watched, call, context, judge))
            return
        self._judge(watched, call, context, judge)

    def settle(self) -> int:
        """Judge the calls recorded during CUDA graph captures, on the values their graphs'
        last replay left in the captured tensors (after a device synchronize); call it after
        replaying. Returns how many were judged."""
        compiled = self._judge_compiled()
        pending, self._pending = self._pending, []
        if pending:  # captured calls are CUDA calls
            torch.cuda.synchronize()
        with torch.no_grad():
            for watched, call, context, judge in pending:
                self._judge(watched, call, context, judge)
        return compiled + len(pending)

    def _judge_compiled(self) -> int:
        """Judge (as sampled) the calls compiled code queued; returns how many were judged."""
        queued = list(self._compiled)
        self._compiled.clear()  # the same list: the hooks hold it
        before = len(self.verdicts)
        for watched, x, y, grad, autocast in queued:
            context = CallContext.of_compiled(x, grad=grad, inference_mode=y.is_inference(), autocast=autocast)
            self._forward_call(watched.module, watched, x, y, context)
        return len(self.verdicts) - before

    def _judge(self, watched: _Watched, call: int, context: CallContext, judge: Any) -> None:
        ratio: float | None = None
        try:
            multiple, message, *compared = judge()
            ratio = compared[0] if compared else None
        except Exception as exc:  # noqa: BLE001 - a call the oracle cannot judge is a failed call, named
            multiple, message = math.inf, f"the oracle could not judge this call: {type(exc).__name__}: {exc}"
        self.verdicts.append(CallVerdict(watched.name, watched.backend, call, context, multiple, message, ratio))

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

    @staticmethod
    def _cached_error(
        cache: dict[torch.dtype, torch.Tensor],
        model: Any,
        packed: Any,
        decoded: _Decoded,
        layer_dtype: torch.dtype,
        compute: torch.dtype,
    ) -> torch.Tensor:
        """``model(packed, weight, layer_dtype)``, kept per layer dtype in ``cache``, plus the
        one more rounding of the dequantized weight that autocast to ``compute`` makes."""
        if layer_dtype not in cache:
            cache[layer_dtype] = model(packed, decoded.weight, layer_dtype)
        error = cache[layer_dtype]
        if compute != layer_dtype:
            error = error + bounds.rounding_bound(decoded.weight.abs() + error, compute)
        return error

    def _weight_error(
        self, packed: Any, decoded: _Decoded, layer_dtype: torch.dtype, compute: torch.dtype
    ) -> torch.Tensor:
        """The bound's weight error (``bounds.layer_weight_error``)."""
        return self._cached_error(decoded.errors, bounds.layer_weight_error, packed, decoded, layer_dtype, compute)

    def _decode_error(
        self, packed: Any, decoded: _Decoded, layer_dtype: torch.dtype, compute: torch.dtype
    ) -> torch.Tensor:
        """The comparative check's allowance for the format's own decode roundings: ``E`` of the
        dequantize-then-multiply model (``bounds.weight_error``), not the bound's wider one that
        also covers bitsandbytes' fused gemv rounding its code table (``layer_weight_error``):
        a gemv that rounds its weights three times is within a factor of torch's one rounding."""
        return self._cached_error(decoded.decode_errors, bounds.weight_error, packed, decoded, layer_dtype, compute)

    def _judge_forward(
        self,
        watched: _Watched,
        module: torch.nn.Module,
        x: torch.Tensor,
        y: Any,
        compute: torch.dtype,
        context: CallContext,
    ) -> tuple[float, str] | tuple[float, str, float | None]:
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
        w_error = self._weight_error(packed, decoded, layer_dtype, compute)
        bound = bounds.matmul_bound(x64, w, b64, compute, y.dtype, w_error=w_error, exact=exact)
        multiple, message = self._compare(y, exact, _rounded_through(bound, exact, compute, y.dtype), "forward")
        if message:
            return multiple, message
        decode_error = self._decode_error(packed, decoded, layer_dtype, compute)
        found = comparative.comparative_linear(y, x, w, b64, exact, compute, w_error=decode_error)
        return self._compare_dense(found, multiple, "forward", "F.linear")

    def _judge_backward(
        self, watched: _Watched, module: torch.nn.Module, dy: torch.Tensor, dx: torch.Tensor, compute: torch.dtype
    ) -> tuple[float, str] | tuple[float, str, float | None]:
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
        w_error = self._weight_error(packed, decoded, layer_dtype, compute)
        bound = bounds.grad_bound(dy64, w, compute, dx.dtype, w_error=w_error)
        multiple, message = self._compare(dx, exact, _rounded_through(bound, exact, compute, dx.dtype), "dx = dy W")
        if message:
            return multiple, message
        dense = comparative.dense_grad_input(dy, w, compute, dx.dtype)
        decode_error = self._decode_error(packed, decoded, layer_dtype, compute).T
        found = comparative.comparative_linear(dx, dy, w.T, None, exact, compute, w_error=decode_error, dense=dense)
        return self._compare_dense(found, multiple, "dx = dy W", "matmul")

    @staticmethod
    def _compare_dense(
        found: comparative.Comparison, multiple: float, what: str, dense_op: str
    ) -> tuple[float, str, float | None]:
        """Within its bound; now against torch's own dense op on the same decoded weight in the
        same dtypes (``reference.comparative``): a call more than ``COMPARATIVE_FACTOR`` times
        less accurate fails with its own message. Too few elements: not compared (None)."""
        if not found.failed:
            return multiple, "", found.ratio
        message = f"{what}: within its worst-case bound ({multiple:.3g} x), but {found.describe(dense_op)}"
        return multiple, message, found.ratio

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
    def worst_comparative(self) -> float | None:
        """The worst comparative ratio of the judged calls (None: none was compared)."""
        return max((v.comparative for v in self.verdicts if v.comparative is not None), default=None)

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

"""The whole model against a float64 replay of the same decoded model (issue 50, model level).

Truth: the *source* float checkpoint the workload quantized (``_workloads.float_model`` with
the seed ``quantized_model`` used, rebuilt here, never read back from the quantized model)
and the bytes each 4-bit layer holds now. The call-site oracle judges every quantized call
against that layer's own bytes; what no single call shows is a tensor that is not a 4-bit
layer (the embedding, a norm, a tied or untied lm_head, the biases, the rotary buffers)
loaded or kept wrong, or errors that compound across layers. So the model is replayed whole:

- the **float64 replay**: the source model's architecture, every 4-bit layer replaced (at its
  module name) by a dense linear holding the float64 decoding of *that layer's own bytes*
  (``LayerFacet.computing_state``, ``faithful.decode``: what the layer computes from) and the
  source's bias; every other tensor the source's, in float64;
- the **noise floor**: the same model in the dtypes the quantized model runs in (the decoded
  weights rounded once to each layer's compute dtype, every other tensor in the dtype the
  quantized model holds it in): torch's own dense model on the same decoded weights.

GPT-2's ``Conv1D`` (weights stored (in, out)) is replaced by a dense linear at the same name,
holding the layer's (out, in) decoding; the per-expert MoE is built through the same structure
(``_workloads._replace_experts``), so its per-expert layers have the quantized model's names;
a PEFT model is read through its base layers (``base_model.model.`` and ``.base_layer`` are
left out of the names). Tied tensors stay tied (GPT-2's lm_head is the source's embedding).

Verdict (``check_model_replay``): the quantized model's logits error against the float64 replay,
compared with the noise floor's, at the real (unpadded) positions, by
``reference.comparative.comparative_ratio`` (the call-level statistic: the ``p``-quantile of
the errors over that of torch's, floored at one rounding of the logits), with every position
judged on one scale (all of them leave the same final norm). Why a correct backend sits near 1
and why ``MODEL_REPLAY_FACTOR = 4``: both models carry the same decoded weights and the same
source tensors and run the same transformers code between the 4-bit layers; they differ only
where the backend's kernels compute (the order of each dot product's additions, and a decode
with more roundings: HQQ's ``(q - z) s`` in the compute dtype rounds twice where the floor
rounds the exact decoding once). Those are independent roundings of the same size as the
floor's own, which every layer's activations, norms and attention add alike to both models:
the quantile of the sum over a few hundred to a few thousand logits is within about 2x of the
floor's for a correct backend (measured: docs/watch.md). An accumulation in a coarser
dtype than the compute dtype (bf16 for an fp16 or fp32 model) errs 8x (fp16) to 2^16x (fp32)
more per operation; a non-4-bit tensor loaded wrong (an lm_head left at a fresh initialization,
an embedding of another checkpoint) moves the logits by O(1) of their size, orders of magnitude
above the floor's ``u sqrt(ops)`` in any dtype. A tensor scaled by ``1 + e`` (one a norm does
not absorb) moves the logits by about ``e``, caught where ``e`` exceeds 4x the floor's relative
error: HQQ's Llama with its final norm scaled, bf16 caught at ``e = 2^-4`` (not at ``2^-6``:
3.1x), fp32 at ``1e-5`` (not at ``1e-6``: 3.8x).

The quantile ``p = 0.9`` (the call level's) also keeps a routed MoE judged: where a token's two
best experts nearly tie, a rounding can route it to the other expert in either model, an O(1)
change of that token's logits; such tokens are a few in a hundred, below the quantile.

Cost: one forward of each of three two-layer models (64 wide, vocabulary 128) and one decode of
each 4-bit layer: the figures are in docs/watch.md.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from pytest_qconform.reference import comparative, faithful

from pytest_qconform.backends.layers import LayerFacet

from ._workloads import _replace_experts

MODEL_REPLAY_FACTOR: float = 4.0  # module docstring: a correct backend sits within ~2x of the floor
MODEL_REPLAY_QUANTILE: float = comparative.COMPARATIVE_QUANTILE

__all__ = ["MODEL_REPLAY_FACTOR", "DenseLinear", "check_model_replay", "replicas", "source_name"]


class DenseLinear(torch.nn.Module):
    """torch's own ``F.linear`` standing in for a 4-bit layer: ``x`` cast to the weight's dtype
    (the layer's compute dtype, or float64), the product returned in ``x``'s dtype, as the
    4-bit layers do."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def source_name(name: str) -> str:
    """A module or tensor name of the quantized model as the source model spells it: a PEFT
    model's ``base_model.model.`` prefix and ``.base_layer`` hops left out."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "")


def quantized_layers(lm: torch.nn.Module, facet: LayerFacet) -> dict[str, torch.nn.Module]:
    """The backend's 4-bit layers of ``lm`` by their source module name."""
    return {source_name(name): m for name, m in lm.named_modules() if facet.owns(m)}


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def replicas(
    facet: LayerFacet, lm: torch.nn.Module, source: torch.nn.Module, device: torch.device
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(float64 replay, noise floor)`` of ``lm`` (module docstring), on ``device``, in eval
    mode. ``source`` is left as it was."""
    layers = quantized_layers(lm, facet)
    if not layers:
        raise ValueError("the model holds no 4-bit layer of this backend: nothing to replay")
    held = {source_name(n): t for n, t in [*lm.named_parameters(), *lm.named_buffers()]}
    built = []
    for exact in (True, False):
        model = copy.deepcopy(source)
        # the per-expert structure: placeholders, replaced by name below like every 4-bit layer
        _replace_experts(model, lambda w, b, name: DenseLinear(w.detach().clone(), None))
        sources = dict(model.named_modules())
        for name, layer in layers.items():
            if name not in sources:
                raise ValueError(f"{name}: a 4-bit layer of the quantized model that the source model lacks")
            bias = getattr(sources[name], "bias", None)
            w = faithful.decode(facet.computing_state(layer), "cpu")
            compute = torch.float64 if exact else (facet.compute_dtype(layer) or _dtype_of(source))
            _set_module(
                model,
                name,
                DenseLinear(w.to(compute), None if bias is None else bias.detach().to(torch.float64).to(compute)),
            )
        if exact:
            model = model.to(torch.float64)
        else:  # each remaining tensor in the dtype the quantized model holds it in (prepare_model_for_kbit_training: fp32)
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                like = held.get(name)
                if name.rpartition(".")[0] in layers or like is None:
                    continue
                if tensor.is_floating_point() and like.is_floating_point() and tensor.dtype != like.dtype:
                    tensor.data = tensor.data.to(like.dtype)
        built.append(model.to(device).eval())
    return built[0], built[1]


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def check_model_replay(
    qcheck,
    facet: LayerFacet,
    lm: torch.nn.Module,
    source: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    grad: bool = False,
    logits: torch.Tensor | None = None,
) -> comparative.Comparison:
    """One forward of ``lm`` (in eval mode: a caller's model in train mode raises) on ``ids``
    and ``mask``, of its float64 replay and of its noise floor (``replicas``): fails when the
    quantized model's logits err more than ``MODEL_REPLAY_FACTOR`` times the floor's against
    the float64 replay (module docstring), or when the replay's own logits are not finite
    (a decoded byte or source tensor that is: never both sides wrong). ``grad``: run ``lm``'s
    forward with grad enabled, as a training step runs its model (a frozen base's layers then
    take their training path), else without. ``logits``: ``lm``'s logits of that forward where
    the workload computed them itself (a prefill on ``ids`` and ``mask``), so that the check runs
    no forward of ``lm`` of its own (in Triton's interpreter, most of its cost). Returns the
    comparison."""
    if any(m.training for m in lm.modules()):
        raise ValueError("check_model_replay compares eval-mode forwards: call lm.eval() first (dropout)")
    rows = mask.bool()
    replay, floor = replicas(facet, lm, source, ids.device)
    with torch.no_grad():
        exact = _logits(replay, ids, mask)[rows]
        dense = _logits(floor, ids, mask)[rows]
    if logits is None:
        with torch.set_grad_enabled(grad):
            logits = _logits(lm, ids, mask)
    actual = logits.detach()[rows]
    if not bool(torch.isfinite(exact).all()):
        raise AssertionError(
            "model replay: the float64 replay's logits are not finite (a 4-bit layer's bytes or a source "
            "tensor decodes to NaN or inf); " + qcheck.where()
        )
    comparison = comparative.comparative_ratio(
        actual, dense, exact, torch.ones((), dtype=torch.float64), quantile=MODEL_REPLAY_QUANTILE
    )
    ratio = comparison.ratio
    qcheck.describe(model_replay_ratio=None if ratio is None else float(f"{ratio:.3g}"))
    if ratio is not None and not ratio <= MODEL_REPLAY_FACTOR:
        raise AssertionError(
            f"model replay: the quantized model's logits err {ratio:.3g} x torch's dense model on the same decoded "
            f"weights (limit {MODEL_REPLAY_FACTOR:g} x), against the float64 replay of its own bytes and the "
            f"source's other tensors, at the {MODEL_REPLAY_QUANTILE * 100:.0f}th percentile over "
            f"{comparison.elements} logits (quantized {comparison.backend_error:.3g}, dense "
            f"{max(comparison.torch_error, comparison.floor):.3g}): a tensor that is not a 4-bit layer (embedding, "
            "norm, lm_head, bias) differs from the source, or the backend computes much coarser than torch; "
            + qcheck.where()
        )
    return comparison

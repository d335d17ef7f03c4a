"""Provenance: the bytes every 4-bit layer holds are the ones its source says.

The call-site oracle's truth is the layer's own bytes at the moment of a call; where the
bytes themselves went wrong (a load that put a neighbour's scales in a layer, a copy that
shares its storage with the original, a move that quantized the weight again), the oracle
agrees with them. This check's truth is outside the layer: the float checkpoint the model
was built from (``Source``: the float model's tensors, with the names the quantized model
uses) and, optionally, the bytes a checkpoint saved. It reads each layer's bytes through
``LayerFacet.packed`` (the bytes a checkpoint written now would hold) and trusts nothing
else in it: no flag, no blocksize it claims, no dequantize of its own.

After any transition a user makes, ``check_provenance`` requires of every 4-bit layer
(``facet.owns``) one of two things:

- **bit-equal to the bytes that were saved** (``saved[name]``, a ``_layers.snapshot``);
- **the quantize-to-nearest of its source weight on its own grid**: decoded in float64,
  within ``reference.requantize.requantize_bound(packed, w, 0)`` of its source ``w``
  (``d(w)`` on the stored grid plus the quantizer's own fp32 arithmetic; the quantizer
  saw ``w`` exactly: the model's dtype is the checkpoint's, so the error of the target is
  0). For the bitsandbytes layout, the grid itself must be the source's too: absmax is
  ``max |w|`` over the block, an exact operation in any float arithmetic (the max of
  values of the weight's dtype, each exact in fp32), so each stored absmax must equal it
  bit for bit. HQQ's scale and zero come from its optimizer and have no such closed form:
  there the grid check is the nearest-value one alone. A layer that fails is also tried
  against every other source weight of its shape, so that a swap (q_proj's bytes in
  k_proj) says whose weight it holds. Where a merge requantized a layer from a computed
  target (PEFT's ``decode + s B A``), ``derived[name] = (target, its error)`` replaces
  the source, as ``_layers.check_requantized`` judges a merge.

Double-quantized absmax (bitsandbytes' ``compress_statistics``) is traced to the source
too (``_nested_differences``): bitsandbytes rounds the codes with the fp32 block maxima
``A_b`` (exact from the source), then stores ``A_b - offset`` as 8-bit codes of the signed
dynamic map in groups of 256 blocks, each group scaled by its ``max |A_b - offset|``. So the
nested code table must be that map bit for bit, the offset the mean of the ``A_b`` (within
fp32 summation), each nested absmax its group's ``max |A_b - offset|`` (within one fp32
rounding), and each stored absmax ``S_b`` within one nested code gap of ``A_b`` (the
quantize check's bound; the search need not pick the nearest of the two codes around a
value); then the grid check runs with ``A_b`` as the grid the quantizer rounded on and
``|S_b - A_b|`` as the stored grid's shift (``requantize.quantizer_block_maxima``). A
double-quantized layer requantized from a computed target (a merge) is judged the same way
with ``A_b`` known to within the block's largest target error: each of the bounds above
widens by it (by the mean of them for the offset), and so does the grid's shift.

Every tensor that is not a 4-bit layer's bytes (embeddings, a tied or untied lm_head,
norms, the biases of the quantized layers, routers) must equal its source bit for bit
after one cast to the dtype the model holds it in: ``source.to(held.dtype)``. That cast
is what ``from_pretrained(dtype=...)``, ``model.to(dtype)`` and PEFT's fp32 upcast of
the non-quantized weights do: round to nearest once (exact when widening), so no other
difference is allowed. Tensors the source has and the model lost, or the model has
and the source never had (LoRA adapters excepted: they are not the checkpoint's), fail.
Tied weights (the source's tensors that share storage, GPT-2's ``lm_head``) must still
share storage in the model.

MoE experts: transformers 5 holds routed experts as 3-D parameters (``gate_up_proj[e]``);
``Source`` names each expert's 2-D weight also as the per-expert module
``<experts>.gate_up.<e>`` / ``<experts>.down.<e>`` that ``_workloads.PerExpertLinears``
quantizes, so they are checked as any layer; a model that kept the 3-D parameter is
compared with it as a float tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from pytest_qconform.reference import bnb4, bounds, formats, requantize
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

from pytest_qconform.backends.layers import LayerFacet

from ._cases import packed_dequantize_bound, reference_decode
from ._layers import lora_delta, merge_dequantized_dtype, quantizer_dtype, snapshot, snapshot_differences
from ._quantizer import U32

PEFT_PREFIX = "base_model.model."
EXPERT_PARTS = {"gate_up_proj": "gate_up", "down_proj": "down"}  # 3-D parameter -> PerExpertLinears list


@dataclass
class Source:
    """A float checkpoint as the quantized model names it: ``tensors`` (every parameter and
    persistent or not buffer of the float model, under every name it has, in the float
    model's own layout), ``transposed`` (the modules whose weight is stored (in, out):
    GPT-2's ``Conv1D``), ``tied`` (names that share one storage), ``experts`` (a 3-D expert
    parameter -> the per-expert layer names it splits into)."""

    tensors: dict[str, torch.Tensor]
    transposed: set[str] = field(default_factory=set)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    experts: dict[str, list[str]] = field(default_factory=dict)

    def weight(self, layer: str) -> torch.Tensor | None:
        """The (out, in) source weight of the 4-bit layer named ``layer``."""
        w = self.tensors.get(layer + ".weight")
        if w is None:
            return None
        return w.T if layer in self.transposed else w


def source_checkpoint(float_model: torch.nn.Module) -> Source:
    """The ``Source`` of a float model (e.g. ``_workloads.float_model(family, dtype, seed)``,
    rebuilt with the workload's seed): host copies of its checkpoint (``state_dict``: the
    parameters and persistent buffers, a tied weight under each of its names), its Conv1D
    modules, its ties and its experts unfolded."""
    tensors: dict[str, torch.Tensor] = {}
    by_storage: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, tensor in float_model.state_dict(keep_vars=True).items():
        tensors[name] = tensor.detach().cpu().clone()
        by_storage.setdefault((tensor.untyped_storage().data_ptr(), tuple(tensor.shape)), []).append(name)
    source = Source(tensors, tied=[tuple(names) for names in by_storage.values() if len(names) > 1])
    for prefix, module in float_model.named_modules():
        if type(module).__name__ == "Conv1D":
            source.transposed.add(prefix)
        for part, listed in EXPERT_PARTS.items():
            value = getattr(module, part, None)
            if isinstance(value, torch.nn.Parameter) and value.dim() == 3:
                key = f"{prefix}.{part}"
                source.experts[key] = [f"{prefix}.{listed}.{e}" for e in range(value.shape[0])]
                for e, layer in enumerate(source.experts[key]):
                    source.tensors[layer + ".weight"] = tensors[key][e]
    return source


def canonical(name: str) -> str:
    """A module or tensor name without PEFT's wrapping (``base_model.model.``, ``.base_layer``)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def quantized_layers(facet: LayerFacet, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's 4-bit layers by canonical name."""
    return {canonical(name): m for name, m in model.named_modules() if facet.owns(m)}


def snapshot_model(facet: LayerFacet, model: torch.nn.Module) -> dict[str, dict[str, object]]:
    """Every 4-bit layer's stored bytes (``_layers.snapshot``) by canonical name: what
    ``check_provenance`` takes as ``saved``."""
    return {name: snapshot(facet, layer) for name, layer in quantized_layers(facet, model).items()}


def _is_adapter(name: str) -> bool:
    return any(part.startswith(("lora_", "modules_to_save")) for part in name.split("."))


def _grid_multiple(
    packed: PackedBnb4 | PackedHqq4, w: torch.Tensor, error: torch.Tensor | None, on_gpu: bool = False
) -> float:
    """``|decode - w| / requantize_bound``'s maximum: at most 1 for ``w``'s quantization on this grid."""
    if tuple(packed.shape) != tuple(w.shape):
        return float("inf")
    target = w.detach().double().cpu()
    error = torch.zeros_like(target) if error is None else error.double().cpu()
    decoded = reference_decode(packed, torch.device("cpu"))
    if not bool(torch.isfinite(decoded).all()):
        return float("inf")
    return float(
        bounds.error_multiple(
            decoded,
            target,
            requantize.requantize_bound(packed, target, error, quantizer_dtype(packed, on_gpu)),
        )
    )


def _nested_differences(packed: PackedBnb4, a: torch.Tensor, slack: torch.Tensor) -> str | None:
    """Where a double-quantized absmax is not the source's (module docstring), else None: ``a``
    each block's max ``|w|`` of the source or target (float64), ``slack`` how far the
    quantizer's block maxima may be from it (0 for a source, the largest error for a target)."""
    code = np.asarray(packed.nested_code, dtype=np.float32).reshape(-1)
    if not np.array_equal(code, np.asarray(formats.dynamic_map_signed(), dtype=np.float32)):
        return "its nested code table is not the signed dynamic map bitsandbytes stores absmax codes of"
    n, group = a.numel(), int(packed.nested_blocksize or 0)
    mean, offset, mean_slack = float(a.mean()), float(packed.offset), float(slack.mean())
    if not abs(offset - mean) <= bounds.gamma(n + 1, U32) * (mean + mean_slack) + mean_slack:
        return f"its absmax offset {offset!r} is not the mean of the source's block maxima ({mean!r})"
    groups = -(-n // max(group, 1))
    nested = torch.as_tensor(np.asarray(packed.nested_absmax, dtype=np.float64)).reshape(-1)
    if group < 1 or nested.numel() != groups:
        return f"{nested.numel()} nested absmax values for {n} blocks in groups of {group}"
    centered = a - offset

    def group_max(values: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(values, (0, groups * group - n)).reshape(groups, group).amax(dim=1)

    spread, group_slack = group_max(centered.abs()), group_max(slack)
    allowed = 2 * U32 * (spread + group_slack) + group_slack
    wrong = torch.nonzero(~((nested - spread).abs() <= allowed)).flatten()  # NaN is wrong too
    if wrong.numel():
        g = int(wrong[0])
        return (
            f"{wrong.numel()} of {groups} nested absmax are not their group's max |absmax - offset| of the "
            f"source (group {g}: stored {float(nested[g])!r}, source {float(spread[g])!r})"
        )
    stored = bnb4.decode_absmax(packed)
    bound = requantize.nested_allowance(packed, a, slack)  # from the quantizer's A_b, within slack of a
    wrong = torch.nonzero(~((stored - a).abs() <= bound + slack)).flatten()
    if wrong.numel() == 0:
        return None
    b = int(wrong[0])
    at = float(nested[b // group]) or 1.0
    normalized = centered / at
    return (
        f"{wrong.numel()} of {n} blocks' absmax decode more than a nested code gap from the block's max |w| "
        f"of the source (block {b}: decodes {float(stored[b])!r}, source max {float(a[b])!r}; normalized "
        f"{float(normalized[b]):.4g} stored as nested code {(float(stored[b]) - offset) / at:.4g})"
    )


def _absmax_differences(packed: PackedBnb4, w: torch.Tensor) -> str | None:
    """Where a plain bitsandbytes-layout absmax is not its block's ``max |w|`` (exact)."""
    expected = requantize.block_maxima(packed, w.detach().cpu().abs()).numpy()
    stored = np.asarray(packed.absmax, dtype=np.float32).reshape(-1).astype(np.float64)
    if stored.shape != expected.shape:
        return f"{stored.size} absmax values for {expected.size} blocks of {packed.blocksize}"
    wrong = np.flatnonzero(stored != expected)
    if wrong.size == 0:
        return None
    b = int(wrong[0])
    return (
        f"{wrong.size} of {stored.size} blocks' absmax are not the block's max |w| of the source "
        f"(block {b}: stored {stored[b]!r}, source max {expected[b]!r})"
    )


def _layer_verdict(
    packed: PackedBnb4 | PackedHqq4, w: torch.Tensor, error: torch.Tensor | None, derived: bool, on_gpu: bool = False
) -> str | None:
    """None when ``packed`` is the quantize-to-nearest of ``w`` on its own grid, else why not."""
    double_quant = isinstance(packed, PackedBnb4) and packed.double_quant
    if tuple(packed.shape) != tuple(w.shape):
        return f"shape {tuple(packed.shape)} != its source's {tuple(w.shape)}"
    try:
        if double_quant:
            target = w.detach().double().cpu()
            slack = torch.zeros_like(target) if error is None else error.detach().double().cpu()
            problem = _nested_differences(packed, *requantize.quantizer_block_maxima(packed, target, slack))
            if problem is not None:
                return problem
        multiple = _grid_multiple(packed, w, error, on_gpu)
    except ValueError as exc:  # a state the reference cannot decode is no weight's quantization
        return f"its bytes do not decode ({exc})"
    if not multiple <= 1.0:
        return f"decodes {multiple:.3g} x the requantization bound away from its source weight"
    if isinstance(packed, PackedBnb4) and not derived and not double_quant:
        return _absmax_differences(packed, w)
    return None


def _whose(packed: PackedBnb4 | PackedHqq4, source: Source, own: str, names: list[str]) -> str:
    """The other source weights (same shape) whose quantization these bytes are."""
    others = []
    for other in names:
        w = source.weight(other)
        if other != own and w is not None and tuple(w.shape) == tuple(packed.shape):
            if _layer_verdict(packed, w, None, False) is None:
                others.append(other)
    return f"; they are the quantization of {', '.join(others)}'s weight instead" if others else ""


def check_provenance(
    qcheck,
    facet: LayerFacet,
    model: torch.nn.Module,
    source: Source,
    *,
    saved: dict[str, dict[str, object]] | None = None,
    derived: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    what: str = "",
) -> None:
    """Every 4-bit layer of ``model`` holds ``saved[name]`` bit for bit or its source
    weight's quantization on its own grid, and every other tensor equals its source after
    the model's dtype cast; ties hold (module docstring). ``saved``: ``snapshot_model`` of
    a model whose bytes were saved; ``derived``: layers requantized from a computed target
    ``(float64 target, its error)``; ``what``: the transition, for the messages."""
    at = f"after {what}: " if what else ""
    layers = quantized_layers(facet, model)
    qcheck.equal(len(layers) > 0, True, f"{at}the model holds 4-bit layers of this backend")
    sources = [name for name in layers if source.weight(name) is not None]
    problems: list[str] = []
    for name, layer in layers.items():
        packed = facet.packed(layer)
        if saved is not None and name in saved and not snapshot_differences(saved[name], snapshot(facet, layer)):
            continue  # bit-equal to the saved bytes
        target, error = derived[name] if derived and name in derived else (source.weight(name), None)
        if target is None:
            problems.append(f"{name}: a 4-bit layer with no source weight")
            continue
        on_gpu = any(t.is_cuda for t in (*layer.parameters(), *layer.buffers()))
        why = _layer_verdict(packed, target, error, derived is not None and name in derived, on_gpu)
        if why is not None:
            saved_too = " nor the saved bytes" if saved is not None and name in saved else ""
            problems.append(
                f"{name}: neither its source's quantization{saved_too}: {why}{_whose(packed, source, name, sources)}"
            )
    qcheck.equal(problems, [], f"{at}4-bit layers whose bytes are not their source's")
    _check_float_tensors(qcheck, facet, model, source, layers, at)


def _check_float_tensors(qcheck, facet, model, source: Source, layers: dict, at: str) -> None:
    held: dict[str, torch.Tensor] = {}
    checkpoint = {canonical(raw): tensor for raw, tensor in _float_state(model, layers).items()}
    for name, tensor in checkpoint.items():
        if not _is_adapter(name):
            held[name] = tensor
    for name, layer in layers.items():
        bias = facet.bias(layer)
        if bias is not None:
            held[name + ".bias"] = bias
    problems = []
    for name, tensor in sorted(held.items()):
        expected = source.tensors.get(name)
        if expected is None:
            problems.append(f"{name}: not in the source checkpoint")
        elif tuple(tensor.shape) != tuple(expected.shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)} != the source's {tuple(expected.shape)}")
        elif not torch.equal(tensor.detach().cpu(), expected.to(tensor.dtype)):
            diff = (tensor.detach().cpu().double() - expected.double()).abs()
            problems.append(
                f"{name}: differs from the source cast to {tensor.dtype} at {int((diff != 0).sum())} elements "
                f"(largest {float(diff.max()):.3g})"
            )
    for name in sorted(source.tensors):
        owner = name.rsplit(".", 1)[0]
        if name in held or name.endswith(".weight") and owner in layers:
            continue  # held, or a 4-bit layer's weight (its bytes, judged above)
        if name in source.experts and all(e in layers for e in source.experts[name]):
            continue  # a 3-D expert parameter quantized as one layer per expert
        if any(name in split for split in map(_expert_weights, source.experts.values())):
            continue  # one expert's 2-D view of a 3-D parameter the model kept (compared as that parameter)
        problems.append(f"{name}: in the source checkpoint, not in the model")
    qcheck.equal(problems, [], f"{at}tensors that are not their source's (after the model's dtype cast)")
    untied = []
    for group in source.tied:
        present = [checkpoint[n] for n in group if n in checkpoint]
        if len(present) > 1 and len({t.untyped_storage().data_ptr() for t in present}) > 1:
            untied.append(" = ".join(group))
    qcheck.equal(untied, [], f"{at}weights tied in the source that no longer share storage")


def _expert_weights(layers: list[str]) -> set[str]:
    return {layer + ".weight" for layer in layers}


def _float_state(model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors outside its 4-bit layers (parameters and persistent
    buffers, each under every name it has), without asking the 4-bit layers to save."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if canonical(prefix) in layers or any(canonical(prefix).startswith(layer + ".") for layer in layers):
            continue
        where = prefix + "." if prefix else ""
        for name, value in module._parameters.items():
            if value is not None:
                found[where + name] = value
        for name, value in module._buffers.items():
            if value is not None and name not in module._non_persistent_buffers_set:
                found[where + name] = value
    return found


def merge_targets(
    lora_modules: dict[str, torch.nn.Module], before: dict, scale: float, sign: float, adapter: str = "default"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``check_provenance``'s ``derived`` for a LoRA merge (``sign`` 1) or unmerge (-1) of
    ``adapter``: per layer (canonical name -> PEFT's LoRA module), ``decode(before) + sign
    s B A`` and its error, as ``_layers.check_requantized`` derives them (PEFT's dequantize
    in the stored dtype, the delta in the adapter's, their sum in the promotion of the two).
    ``before``: each layer's ``facet.packed`` just before the merge."""
    targets = {}
    for name, module in lora_modules.items():
        delta, e_delta, adapter_dtype = lora_delta(module, scale, adapter)
        w = reference_decode(before[name], delta.device)
        target = w + sign * delta
        dequantized = merge_dequantized_dtype(before[name])
        error = (
            packed_dequantize_bound(before[name], w, dequantized)
            + e_delta
            + bounds.rounding_bound(target.abs() + e_delta, torch.promote_types(dequantized, adapter_dtype))
        )
        targets[name] = (target, error)
    return targets

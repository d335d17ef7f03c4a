"""Provenance after every transition a user makes: each 4-bit layer's bytes traced to the
weights it came from (``_provenance.check_provenance``).

A workload model (``_workloads.quantized_model``: from_pretrained with the backend's
quantization config where its layer claims transformers, else its layers replaced) is
built from a float checkpoint whose ``Source`` the test keeps, then taken through one
transition (the ``transition`` axis, ``cases.axes.TRANSITIONS``): loaded (a pre-quantized
checkpoint; ``load_state_dict`` into a model built from other weights, with and without
``assign=True``; a model moved to the meta device, then loaded), copied (``copy.deepcopy``,
as a DPO reference model is made, and a copied ``state_dict``: each copy written after,
and the other must stay bit-equal) or cast (``.to(float32)`` and back). Two transitions
that not every layer claims are tests of their own in the same operation: PEFT (adapters
loaded, set, deleted and hot-swapped, then merged and unmerged) and ``.cpu()`` /
``.cuda()`` round trips (GPU only). After each step every 4-bit layer holds the saved
bytes or its source's quantization, every other tensor its source's, ties hold.

Instances: the workload axes and the transition; in ``ci`` each value once (every
transition on every backend, the families cycling through them), all pairs in
``thorough``; the PEFT and device tests once per format (HQQ: grouping axis), in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pytest_qconform.session.outcomes import skip_not_claimed, skip_other_device

from ._layers import needs, require_layer_claim, snapshot_differences
from ._provenance import Source, check_provenance, merge_targets, quantized_layers, snapshot_model, source_checkpoint
from ._workloads import float_model, lora_layers, lora_targets, quantized_model

SEED, OTHER_SEED = 211, 223  # the model's float checkpoint; another one, for a model to load into
RANK, ALPHA = 4, 8  # LoRA scaling alpha / r = 2, a power of two


def _built(qcheck, facet, caps, spec, model, dtype, device, path, seed=SEED):
    lm = quantized_model(qcheck, facet, caps, spec, model, dtype, device, path, seed=seed)
    return lm, source_checkpoint(float_model(model, dtype, seed))


def _by_transformers(qcheck) -> bool:
    return str(qcheck.context.get("built_by", "")).startswith("from_pretrained")


def _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path):
    """A model of the same family built from another checkpoint: what a state is loaded into."""
    described = dict(qcheck.context)
    other, _ = _built(qcheck, facet, caps, spec, model, dtype, device, tmp_path / "other", OTHER_SEED)
    qcheck.context = described
    return other


def _write(model: torch.nn.Module, facet, state: dict[str, torch.Tensor]) -> str:
    """Write into ``model`` in place as a user does: scale its embedding (a float weight),
    then load another checkpoint's state into it (its 4-bit layers' bytes). A layer that
    refuses the load is allowed (checkpoint suite); returns what was written."""
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(2)
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:  # noqa: BLE001 - refusing a load is allowed
        return f"embedding scaled; the load was refused ({type(exc).__name__})"
    return "embedding scaled, another checkpoint loaded"


def _peft_model(facet, lm, tmp_path):
    peft = needs("peft")
    torch.manual_seed(601)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=lora_targets(lm, facet), lora_dropout=0.0, init_lora_weights=False
    )
    return peft, peft.get_peft_model(lm, config)


PROVENANCE = pytest.mark.qconform_operation("provenance")


@pytest.mark.qconform_axes("model", "format", "double_quant", "hqq_axis", "dtype", "transition")
@pytest.mark.qconform_ci_strength(1)
@PROVENANCE
def test_provenance_after_transition(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype, transition):
    """After ``transition`` every 4-bit layer holds its saved bytes or its source's
    quantization, every other tensor its source's, and ties hold."""
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype)
    if transition == "dtype-round-trips":
        require_layer_claim(qbackend, qtarget, spec, dtype, move="to")
    lm, source = _built(qcheck, facet, caps, spec, model, dtype, qdevice, tmp_path)
    qcheck.describe(transition=transition, source_seed=SEED)
    check_provenance(qcheck, facet, lm, source, what="the build")
    TRANSITIONS[transition](qcheck, facet, caps, spec, model, dtype, qdevice, tmp_path, lm, source)


def _model_dtype(target) -> torch.dtype:
    return torch.bfloat16 if target.bf16 else torch.float16


@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "hqq_axis")  # PEFT wraps and merges whatever layout
@PROVENANCE
def test_provenance_through_peft(qtarget, qbackend, qdevice, qcheck, tmp_path, spec):
    """Qwen2 (biased q/k/v) with PEFT LoRA on every 4-bit layer: adapters saved, loaded,
    set, deleted and hot-swapped, then merged and unmerged (``_peft_adapter_swaps``,
    ``_peft_merge_unmerge``)."""
    dtype = _model_dtype(qtarget)
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype, peft=True)
    lm, source = _built(qcheck, facet, caps, spec, "qwen2", dtype, qdevice, tmp_path)
    qcheck.describe(source_seed=SEED)
    check_provenance(qcheck, facet, lm, source, what="the build")
    saved = snapshot_model(facet, lm)
    _, wrapped = _peft_model(facet, lm, tmp_path)
    check_provenance(qcheck, facet, wrapped, source, saved=saved, what="get_peft_model")
    _peft_adapter_swaps(qcheck, facet, wrapped, source, saved, tmp_path)
    _peft_merge_unmerge(qcheck, facet, wrapped, source, saved)


@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "hqq_axis")  # moves keep whatever bytes
@PROVENANCE
def test_provenance_after_device_round_trips(qtarget, qbackend, qdevice, qcheck, tmp_path, spec):
    """GPT-2 (tied lm_head, Conv1D) quantized on the GPU, then ``.cpu()`` / ``.cuda()`` and
    ``.to("cpu")`` / ``.to(device)``, each claimed move, twice: the bytes, the float tensors
    and the tie all come back."""
    if qdevice.type != "cuda":
        skip_other_device("GPU only: .cpu() / .cuda() round trips need a GPU; this run computes on the CPU")
    dtype = _model_dtype(qtarget)
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype)
    lm, source = _built(qcheck, facet, caps, spec, "gpt2", dtype, qdevice, tmp_path)
    qcheck.describe(source_seed=SEED)
    check_provenance(qcheck, facet, lm, source, what="the build")
    saved = snapshot_model(facet, lm)
    trips = []
    if "cpu" in caps.moves and "cuda" in caps.moves:
        trips.append(("cpu()/cuda()", lambda m: m.cpu(), lambda m: m.cuda(qdevice)))
    if "to" in caps.moves:
        trips.append(('to("cpu")/to(device)', lambda m: m.to("cpu"), lambda m: m.to(qdevice)))
    if not trips:
        skip_not_claimed("the layer claims no device move")
    for _ in range(2):
        for name, away, back in trips:
            lm = away(lm)
            check_provenance(qcheck, facet, lm, source, saved=saved, what=name.split("/")[0])
            lm = back(lm)
            check_provenance(qcheck, facet, lm, source, saved=saved, what=name)


def _pre_quantized(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
    """save_pretrained -> from_pretrained where transformers built the model; else the
    state dict through a file into a model built from other weights."""
    saved = snapshot_model(facet, lm)
    if caps.transformers and _by_transformers(qcheck) and model != "moe":  # no transformers class loads our MoE
        import transformers

        lm.save_pretrained(tmp_path / "quantized")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", device_map=str(device))
        check_provenance(qcheck, facet, loaded, source, saved=saved, what="save_pretrained -> from_pretrained")
        return
    torch.save(lm.state_dict(), tmp_path / "quantized.pt")
    other = _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path)
    if not _loaded(qcheck, facet, other, torch.load(tmp_path / "quantized.pt", weights_only=True), saved, assign=False):
        return
    check_provenance(qcheck, facet, other, source, saved=saved, what="state_dict -> file -> load_state_dict")


def _load_state_dict(assign: bool):
    def transition(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
        """``load_state_dict`` of the model's state into a model built from other weights."""
        saved = snapshot_model(facet, lm)
        other = _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path)
        if not _loaded(qcheck, facet, other, lm.state_dict(), saved, assign=assign):
            return
        check_provenance(qcheck, facet, other, source, saved=saved, what=f"load_state_dict(assign={assign})")

    return transition


def _loaded(qcheck, facet, model, state, saved, *, assign: bool) -> bool:
    """``model.load_state_dict(state, strict=True)``: True when it loaded. A load may refuse
    with an error (the checkpoint suite's rule), but a refused load must leave each 4-bit
    layer whole: its own bytes or the checkpoint's, never a mix (torch copies every key it
    knows before it raises on the ones it does not)."""
    on_meta = any(t.is_meta for t in model.state_dict().values())
    own = {} if on_meta else snapshot_model(facet, model)
    try:
        model.load_state_dict(state, strict=True, assign=assign)
    except Exception as exc:  # noqa: BLE001 - refusing is allowed; loading half of it is not
        qcheck.describe(load_refused=f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        if on_meta:
            return False  # a meta layer holds no bytes to mix: it cannot compute until loaded
        mixed = [
            name
            for name, layer in snapshot_model(facet, model).items()
            if snapshot_differences(own[name], layer) and snapshot_differences(saved.get(name, {}), layer)
        ]
        qcheck.equal(mixed, [], "4-bit layers a refused load_state_dict left neither as they were nor as loaded")
        return False
    return True


def _meta_then_load(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
    """A model of other weights moved to the meta device (as ranks but the first are before
    rank 0's weights arrive), then ``load_state_dict(assign=True)``."""
    saved = snapshot_model(facet, lm)
    other = _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path)
    try:
        other = other.to("meta")
    except Exception as exc:  # noqa: BLE001 - a layer class that cannot be on meta does not claim this path
        refused = f"{type(exc).__name__}: {str(exc)[:100]}"
        if not (caps.transformers and _by_transformers(qcheck)):
            skip_not_claimed(f"the layer cannot move to the meta device ({refused})")
        if model == "moe":  # the per-expert MoE is this suite's own module: no transformers class loads it
            pytest.skip(
                f"the layer cannot move to the meta device ({refused}), and from_pretrained, which builds "
                "on meta, loads no per-expert MoE (the workloads' own module)"
            )
        # bitsandbytes' Params4bit cannot go to meta by hand; transformers builds every model
        # there and loads into it, which is how its users build one on meta
        import transformers

        qcheck.describe(to_meta_refused=refused, meta_by="from_pretrained (it builds on meta, then loads)")
        lm.save_pretrained(tmp_path / "quantized")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", device_map=str(device))
        check_provenance(qcheck, facet, loaded, source, saved=saved, what="from_pretrained onto a meta skeleton")
        return
    if not _loaded(qcheck, facet, other, lm.state_dict(), saved, assign=True):
        return
    check_provenance(qcheck, facet, other, source, saved=saved, what="to('meta') -> load_state_dict(assign=True)")


def _deepcopy(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
    """``copy.deepcopy`` (a frozen reference model for DPO): the copy holds the same bytes,
    and writing it (an in-place scale of its embedding, another checkpoint loaded into it)
    leaves the original bit-equal."""
    saved = snapshot_model(facet, lm)
    reference = copy.deepcopy(lm)
    check_provenance(qcheck, facet, reference, source, saved=saved, what="copy.deepcopy (the copy)")
    other = _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path)
    written = _write(reference, facet, other.state_dict())
    qcheck.describe(written_into_the_copy=written)
    check_provenance(qcheck, facet, lm, source, saved=saved, what=f"copy.deepcopy, then {written} into the copy")


def _state_dict_copy(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
    """``copy.deepcopy(model.state_dict())`` kept while the model is written (an embedding
    scaled, another checkpoint loaded): loaded back, the copy restores the model."""
    saved = snapshot_model(facet, lm)
    kept = copy.deepcopy(lm.state_dict())
    other = _other(qcheck, facet, caps, spec, model, dtype, device, tmp_path)
    written = _write(lm, facet, other.state_dict())
    qcheck.describe(written_into_the_model=written)
    if not _loaded(qcheck, facet, lm, kept, saved, assign=False):
        return
    check_provenance(qcheck, facet, lm, source, saved=saved, what=f"a state_dict copy kept, {written}, copy loaded")


def _dtype_round_trips(qcheck, facet, caps, spec, model, dtype, device, tmp_path, lm, source: Source) -> None:
    """``.to(float32)`` and back, twice (``.float()`` the second time): the float tensors
    are cast (exactly, widening and back), the 4-bit layers' bytes stay."""
    saved = snapshot_model(facet, lm)
    for there, name in ((lambda m: m.to(torch.float32), "to(float32)"), (lambda m: m.float(), "float()")):
        try:
            lm = there(lm)
        except ValueError as exc:  # transformers refuses to cast a bitsandbytes model: a clear answer
            qcheck.describe(cast_refused=str(exc).splitlines()[0][:100])
            check_provenance(qcheck, facet, lm, source, saved=saved, what=f"the refused .{name}")
            return
        check_provenance(qcheck, facet, lm, source, saved=saved, what=f".{name}")
        lm = lm.to(dtype)
        check_provenance(qcheck, facet, lm, source, saved=saved, what=f".{name} and back")


def _peft_merge_unmerge(qcheck, facet, wrapped, source: Source, saved) -> None:
    """``merge_adapter`` requantizes each targeted layer from ``decode + s B A`` and
    ``unmerge_adapter`` from ``decode - s B A`` (each judged as the merge workload judges
    it: ``derived``); every other tensor and layer keeps its source's."""
    layers = {name.removeprefix("base_model.model."): m for name, m in lora_layers(wrapped, facet).items()}
    for step, sign in (("merge_adapter", 1.0), ("unmerge_adapter", -1.0)):
        before = {name: facet.packed(module.get_base_layer()) for name, module in layers.items()}
        getattr(wrapped, step)()
        derived = merge_targets(layers, before, ALPHA / RANK, sign, wrapped.active_adapter)
        check_provenance(qcheck, facet, wrapped, source, saved=saved, derived=derived, what=step)


def _peft_adapter_swaps(qcheck, facet, wrapped, source: Source, saved, tmp_path) -> None:
    """Adapters saved, loaded beside the first (``load_adapter``), made active
    (``set_adapter``), the first deleted (``delete_adapter``), and one hot-swapped in
    (``peft.utils.hotswap.hotswap_adapter``, where PEFT has it): the base layers' bytes
    stay bit-equal to the built model's after each."""
    wrapped.save_pretrained(tmp_path / "adapter")
    steps = [
        ("load_adapter", lambda: wrapped.load_adapter(tmp_path / "adapter", adapter_name="second")),
        ("set_adapter", lambda: wrapped.set_adapter("second")),
        ("delete_adapter", lambda: wrapped.delete_adapter("default")),
    ]
    try:
        from peft.utils.hotswap import hotswap_adapter
    except ImportError:
        qcheck.describe(hotswap="not in this PEFT")
    else:
        steps.append(("hotswap_adapter", lambda: hotswap_adapter(wrapped, str(tmp_path / "adapter"), "second")))
    for name, step in steps:
        step()
        check_provenance(qcheck, facet, wrapped, source, saved=saved, what=name)
    qcheck.equal(len(quantized_layers(facet, wrapped)), len(saved), "4-bit layers after the adapter swaps")
    wrapped.set_adapter("second")


TRANSITIONS = {
    "built": lambda *args: None,  # the build itself, checked in every instance
    "pre-quantized": _pre_quantized,
    "load-state-dict": _load_state_dict(assign=False),
    "load-state-dict-assign": _load_state_dict(assign=True),
    "meta-then-load": _meta_then_load,
    "deepcopy": _deepcopy,
    "state-dict-copy": _state_dict_copy,
    "dtype-round-trips": _dtype_round_trips,
}

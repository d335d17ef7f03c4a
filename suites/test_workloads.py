"""Real workloads, every quantized call judged: generate, serving, a QLoRA training step,
save and load, on several model families (``_workloads``).

The workload is the input. Inside it, the call-site oracle (``qwatch``, i.e.
``pytest_qconform.watch``) judges each sampled call of every quantized layer against the
float64 reference of that layer's own bytes at that moment, with the context the call
ran in (no grad, inference mode, autocast, recomputation under gradient checkpointing,
3-D views, the row count of each decode step). Each workload is a matrix cell
(``workload:<pipeline>``); the report's ``calls`` section lists the contexts judged per
backend. What the workload itself must do beyond its calls (adapters that receive a
gradient, an optimizer update that follows from it, a reloaded model that computes what
the saved one did) is checked here too. Each workload ends with truths from outside its
layers, the float checkpoint it was built from: provenance (``_provenance.check_provenance``:
every 4-bit layer holds its source weight's quantization to nearest, or the bytes it saved,
or its merge's target, and every other tensor its source's) and the model-level check
(``_replay.check_model_replay``): its model's logits against a float64 replay of the layers'
own bytes and the source checkpoint's other tensors, as close as torch's dense model on the
same decoded weights, which sees what no single call shows (an embedding, norm, lm_head or
bias that is not the source's; errors that compound across layers).

Instances: the ``model`` axis with the settings users set (``WORKLOAD_AXES``: format, packed
storage dtype, compute dtype); in the ``ci`` profile each value once
(every pipeline runs on every backend, each family, format, setting and dtype once; the
QLoRA step every storage dtype with every compute dtype, FSDP-QLoRA's bf16 with bf16 among
them), all pairs in ``thorough``.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from pytest_qconform.session.outcomes import skip_other_device

from ._cases import reference_decode
from ._layers import check_requantized, lora_delta, needs, require_layer_claim, snapshot, snapshot_differences
from ._provenance import check_provenance, merge_targets, snapshot_model, source_checkpoint
from ._replay import check_model_replay
from ._workloads import (
    SOURCE_SEED,
    LoraCalls,
    accumulated_lora_gradients,
    check_cache_filled,
    check_first_adamw_step,
    float_model,
    lora_layers,
    lora_targets,
    prompts,
    quantized_model,
)

# The settings users set are axes beside the model: the format, HQQ's grouping axis, the
# packed storage dtype (FSDP-QLoRA stores the bytes as bf16, passed as transformers'
# ``bnb_4bit_quant_storage`` or ``Linear4bit(quant_storage=...)``), double quantization
# (``bnb_4bit_use_double_quant``, QLoRA's setting: each workload's provenance traces a
# double-quantized absmax, its nested absmax and offset to the source, ``_provenance``) and
# the compute dtype.
WORKLOAD_AXES = ("model", "format", "double_quant", "hqq_axis", "quant_storage", "dtype")
# Each instance runs a model, seconds each (2-9 s on an H200 and on the 2-core CPU, a compiled
# one up to 28 s): at the heads of the workers' shares, so that the run does not end with a
# worker running the last of them while the others wait (on the CPU the main job's two workers
# ended 7 s apart with three serving workloads last, 2026-11-29; docs/run-times.md).
pytestmark = pytest.mark.qconform_heavy
NEW_TOKENS = 3
LONG_PREFILL = 96
RANK, ALPHA = 4, 8
SERVED_LENGTH, CACHE_LENGTH = 5, 16  # compiled and captured serving: static KV cache
DECODE_STEPS = 2  # decode steps after a prefill, in each serving workload
WARMUP_CALLS = 2  # eager decode steps on a side stream before a capture, as torch.cuda.graphs documents


def _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype, **claims):
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype, **claims)
    lm = quantized_model(qcheck, facet, caps, spec, model, dtype, qdevice, tmp_path)
    return facet, caps, lm


def _check_outside_truth(
    qcheck, facet, lm, model, dtype, ids, mask, *, grad: bool = False, logits=None, saved=None, derived=None
) -> None:
    """The workload's model ``lm`` (in eval mode) against truths from outside its layers,
    the float checkpoint ``quantized_model`` quantized (rebuilt from its seed):

    - provenance (``_provenance.check_provenance``): every 4-bit layer holds its source
      weight's quantization to nearest (or ``saved``'s bytes, or a merge's ``derived``
      target's), every other tensor its source's, ties kept;
    - the model-level check (``_replay.check_model_replay``) on one forward of ``ids``: its
      logits against the float64 replay of its own bytes and of its source, as close as
      torch's dense model on the same decoded weights."""
    with torch.random.fork_rng(devices=[]):  # float_model seeds the global generator: the workload's stays
        source = float_model(model, dtype, SOURCE_SEED)
    check_provenance(qcheck, facet, lm, source_checkpoint(source), saved=saved, derived=derived, what="the workload")
    check_model_replay(qcheck, facet, lm, source, ids, mask, grad=grad, logits=logits)


def workload(pipeline: str, **only: tuple):
    """The markers of a workload check: its operation, its axes (``only``: the values an axis
    is limited to), one of each value in ``ci``."""

    def mark(test):
        test = pytest.mark.qconform_axes(*WORKLOAD_AXES, **only)(test)
        test = pytest.mark.qconform_ci_strength(1)(test)
        return pytest.mark.qconform_operation(f"workload:{pipeline}")(test)

    return mark


@workload("generate")
def test_generate(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype):
    """Greedy ``generate()`` on a left-padded batch of prompts of different lengths (KV
    cache, attention mask), then a long prefill: every step's calls judged."""
    facet, _, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype)
    lm.eval()
    ids, mask = prompts((5, 2, 7), seed=307, device=qdevice)
    long_ids, long_mask = prompts((LONG_PREFILL,), seed=311, device=qdevice)
    with qwatch(lm, {qbackend.name: facet}):
        out = lm.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
        lm.generate(input_ids=long_ids, attention_mask=long_mask, max_new_tokens=1, do_sample=False, pad_token_id=0)
    qcheck.equal(tuple(out.sequences.shape), (3, ids.shape[1] + NEW_TOKENS), "generate's output shape")
    check_cache_filled(qcheck, out.past_key_values, ids.shape[1] + NEW_TOKENS - 1)  # the last token is not fed back
    _check_outside_truth(qcheck, facet, lm, model, dtype, ids, mask)


@workload("serving")
def test_serving(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype):
    """As serving code calls a model: ``inference_mode``, a batched prefill with a KV cache,
    then decode steps of one token per request, on a side stream where there is a GPU."""
    facet, _, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype)
    lm.eval()
    ids, prompt_mask = prompts((6, 3, 1), seed=313, device=qdevice)
    mask = prompt_mask
    stream = torch.cuda.Stream(qdevice) if qdevice.type == "cuda" else None
    with qwatch(lm, {qbackend.name: facet}), torch.inference_mode():
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
            prefill_logits, cache = out.logits, out.past_key_values
            for _ in range(DECODE_STEPS):
                token = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                out = lm(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
        if stream is not None:
            torch.cuda.current_stream(qdevice).wait_stream(stream)
    qcheck.equal(bool(torch.isfinite(out.logits).all()), True, "the served logits are finite")
    check_cache_filled(qcheck, cache, ids.shape[1] + DECODE_STEPS)
    _check_outside_truth(qcheck, facet, lm, model, dtype, ids, prompt_mask, logits=prefill_logits)


def _static_cache(lm, ids):
    """A ``StaticCache`` (fixed shapes, what compiled and captured decoding needs) and the
    prompt's cache positions."""
    transformers = needs("transformers")
    cache = transformers.StaticCache(config=lm.config, max_cache_len=CACHE_LENGTH)
    return cache, torch.arange(ids.shape[1], device=ids.device)


def _judged(oracle, word: str) -> int:
    """Judged calls whose context signature has ``word`` (``compiled``, ``captured``)."""
    return sum(n for (_, signature), n in oracle.judged.items() if word in signature.split())


@workload(
    "compiled",
    model=("qwen2",),
    format=("nf4", "hqq4"),
    # One instance per backend: each compiles two graphs (10-20 s on an H100). The storage and
    # double quantization are held at their defaults here (uint8, off); every other workload
    # varies them, and test_compiled.py compiles double-quantized layers.
    double_quant=(False,),
    hqq_axis=(1,),
    quant_storage=(torch.uint8,),
    dtype=(torch.bfloat16,),
)
def test_compiled_serving(qtarget, qbackend, qdevice, qcheck, qwatch, qprofile, tmp_path, spec, model, dtype):
    """Serving through ``torch.compile`` as users compile a model right after loading it (no
    eager call first): a static KV cache, a prefill and decode steps of the compiled model.
    Inside it each layer's call is compiled code; the oracle judges every sampled one as a
    compiled call, and a run in which no call was compiled (dynamo fell back to eager) fails.
    The default mode: capture into CUDA graphs is ``workload:captured``'s.

    One family (Qwen2: biased q/k/v), NF4 (HQQ: its 4-bit, axis 1, its default) in bf16, as
    served; each instance compiles two graphs (prefill, decode), 10-20 s on an H100, so it
    runs first (``qconform_heavy``). On a CPU in the ``thorough`` profile only: inductor
    compiles C++ there, 15-50 s an instance on a 2-core CPU."""
    if qdevice.type != "cuda" and qprofile != "thorough":
        skip_other_device(
            "compiled workloads run on GPUs, and on a CPU in the thorough profile "
            "(inductor's C++ compiles, 15-30 s an instance)"
        )
    facet, _, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype)
    lm.eval()
    torch._dynamo.reset()  # this instance's graphs, not an earlier instance's cached code
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lm, dynamic=False)
    ids, prompt_mask = prompts((SERVED_LENGTH, SERVED_LENGTH), seed=317, device=qdevice)
    cache, positions = _static_cache(lm, ids)
    try:
        with qwatch(lm, {qbackend.name: facet}) as oracle, torch.no_grad():
            out = compiled(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)
            logits = out.logits.clone()
            oracle.settle()  # each step's calls judged before the next step (as under reduce-overhead)
            for step in range(DECODE_STEPS):
                token = logits[:, -1:].argmax(-1)
                position = torch.tensor([SERVED_LENGTH + step], device=qdevice)
                logits = compiled(input_ids=token, past_key_values=cache, cache_position=position).logits.clone()
                oracle.settle()
    finally:
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        torch._dynamo.reset()
    qcheck.describe(graph_breaks=breaks)  # the backend's own (the oracle's hooks break no graph)
    qcheck.equal(_judged(oracle, "compiled") > 0, True, "calls judged as compiled (dynamo compiled the layers)")
    qcheck.equal(bool(torch.isfinite(logits).all()), True, "the served logits are finite")
    check_cache_filled(qcheck, cache, SERVED_LENGTH + DECODE_STEPS)
    _check_outside_truth(qcheck, facet, lm, model, dtype, ids, prompt_mask)  # the eager model, after its compiled use


# The storage dtypes of serving and of FSDP-QLoRA's checkpoints (uint8, bf16): with the three
# compute dtypes, still three instances per backend (each value once).
@workload("captured", model=("llama", "qwen2"), quant_storage=(torch.uint8, torch.bfloat16))
def test_captured_decode(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype):
    """The decode step as serving engines run it (vLLM and SGLang capture it): a static KV
    cache, eager warm-up steps on a side stream, the step captured in a CUDA graph, then
    replayed for each new token with the token and its position copied into the graph's
    static inputs. The warm-ups run on a cache of their own, prefilled alike: transformers'
    ``StaticCache`` writes each step at its own running length (a device counter, which a
    replay advances too), not at ``cache_position``, so warm-ups on the served cache would
    leave their tokens in it and shift every replayed step's keys past its mask. A call made
    during the capture has no values yet; the oracle judges it on the values the last replay
    left (``oracle.settle()``). On a GPU only."""
    if qdevice.type != "cuda":
        skip_other_device("GPU only: a CUDA graph captures GPU kernels, this run computes on the CPU")
    facet, _, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype)
    lm.eval()
    ids, prompt_mask = prompts((SERVED_LENGTH, SERVED_LENGTH), seed=331, device=qdevice)
    cache, positions = _static_cache(lm, ids)
    scratch, _ = _static_cache(lm, ids)  # the warm-ups'
    with qwatch(lm, {qbackend.name: facet}) as oracle, torch.inference_mode():
        out = lm(input_ids=ids, past_key_values=cache, cache_position=positions, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)  # the graph's static inputs
        position = torch.tensor([SERVED_LENGTH], device=qdevice)

        def step(kv):
            return lm(input_ids=token, past_key_values=kv, cache_position=position, use_cache=True).logits

        side = torch.cuda.Stream(qdevice)
        side.wait_stream(torch.cuda.current_stream(qdevice))
        with torch.cuda.stream(side):
            lm(input_ids=ids, past_key_values=scratch, cache_position=positions, use_cache=True)
            for _ in range(WARMUP_CALLS):
                step(scratch)
        torch.cuda.current_stream(qdevice).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step(cache)
        for _ in range(DECODE_STEPS):
            graph.replay()
            token.copy_(logits[:, -1:].argmax(-1))
            position.add_(1)
        torch.cuda.synchronize(qdevice)
        judged = oracle.settle()
    qcheck.equal(judged > 0 and _judged(oracle, "captured") == judged, True, "captured calls judged after replay")
    qcheck.equal(bool(torch.isfinite(logits).all()), True, "the replayed logits are finite")
    check_cache_filled(qcheck, cache, SERVED_LENGTH + DECODE_STEPS)
    _check_outside_truth(qcheck, facet, lm, model, dtype, ids, prompt_mask)  # the eager model, after its captured use


@pytest.mark.qconform_axes(*WORKLOAD_AXES, "checkpointing")
# Each storage dtype with each compute dtype: FSDP-QLoRA's setting (the bytes stored as the
# dtype the model trains in, bf16 with bf16) runs here in one process, as do its fp32 and fp16
# forms; a step costs a fraction of a second on a CPU (12 bitsandbytes instances instead of 4).
@pytest.mark.qconform_ci_strength(1, jointly=("quant_storage", "dtype"))
@pytest.mark.qconform_operation("workload:qlora-step")
def test_qlora_training_step(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype, checkpointing):
    """A QLoRA step as PEFT and a trainer run it: ``prepare_model_for_kbit_training`` with
    gradient checkpointing (the instance's variant), LoRA on every quantized layer,
    mixed precision (autocast in the compute dtype), two micro-batches of gradient
    accumulation, one AdamW step. Every base-layer call is judged, forward, recomputed
    and backward (``dx = dy W``); every adapter must then hold a finite gradient (a
    reentrant checkpoint over a frozen base leaves them without one: transformers#26221,
    peft#1142), and the update must be AdamW's first step of that gradient."""
    peft = needs("peft")
    facet, caps, lm = _workload(
        qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype, backward=True, peft=True
    )
    lm = peft.prepare_model_for_kbit_training(
        lm,
        use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"},
    )
    qcheck.equal(
        lm.is_gradient_checkpointing, True, "gradient checkpointing, enabled by prepare_model_for_kbit_training"
    )
    torch.manual_seed(401)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=lora_targets(lm, facet), lora_dropout=0.0, init_lora_weights=False
    )
    lm = peft.get_peft_model(lm, config)
    lm.train()
    adapters = {name: p for name, p in lm.named_parameters() if p.requires_grad}
    qcheck.describe(lora=f"r={RANK} on {','.join(config.target_modules)}", adapters=len(adapters))
    lr, eps = 1e-3, 1e-8
    optimizer = torch.optim.AdamW(adapters.values(), lr=lr, eps=eps, weight_decay=0.0)
    micro_batches = [prompts((8, 8), seed=409 + i, device=qdevice) for i in range(2)]
    autocast_dtype = dtype if dtype is not torch.float32 else None
    lora_calls = LoraCalls(lm, facet)
    with qwatch(lm, {qbackend.name: facet}):
        for ids, mask in micro_batches:
            with torch.autocast(qdevice.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = lm(input_ids=ids, attention_mask=mask, labels=ids).loss / len(micro_batches)
            loss.backward()
    lora_calls.remove()
    missing = sorted(name for name, p in adapters.items() if p.grad is None)
    qcheck.equal(missing[:3], [], f"adapters without a gradient ({len(missing)} of {len(adapters)})")
    nonfinite = sorted(name for name, p in adapters.items() if not bool(torch.isfinite(p.grad).all()))
    qcheck.equal(nonfinite[:3], [], f"adapters with a non-finite gradient ({len(nonfinite)} of {len(adapters)})")
    _check_lora_gradients(qcheck, facet, lora_calls, qdevice)
    before = {name: (p.detach().double().clone(), p.grad.detach().double().clone()) for name, p in adapters.items()}
    optimizer.step()
    check_first_adamw_step(qcheck, adapters, before, lr, eps)
    # The frozen base after the step (adapters disabled; prepare_model_for_kbit_training's fp32
    # norms and embeddings), in eval mode (GPT-2's dropout) and with grad, so that its layers take
    # the path the step ran (without grad, bitsandbytes' CPU inference kernel: the other workloads'
    # known failures).
    lm.eval()
    with lm.disable_adapter():
        _check_outside_truth(qcheck, facet, lm, model, dtype, *micro_batches[0], grad=True)


def _check_lora_gradients(qcheck, facet, lora_calls, device) -> None:
    """Each adapter's accumulated gradient against float64 from its layer's own bytes and
    the inputs and upstream gradients it received (``_workloads.accumulated_lora_gradients``):
    a float64 shadow of every LoRA layer, fed what the model fed it."""
    qcheck.equal(
        sorted(name for name, calls in lora_calls.calls.items() if not calls),
        [],
        "LoRA layers whose backward never ran",
    )
    for name, module in lora_calls.layers.items():
        base = module.get_base_layer()
        packed = facet.computing_state(base)
        w = reference_decode(packed, device)
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        grads = accumulated_lora_gradients(
            lora_calls.calls[name],
            packed,
            w,
            a.detach().double(),
            b.detach().double(),
            ALPHA / RANK,
            facet.compute_dtype(base) or a.dtype,
            a.dtype,
        )
        short = name.split("model.", 1)[-1]
        for what, parameter in (("lora_A", a), ("lora_B", b)):
            if parameter.grad is not None:
                exact, bound = grads[what]
                qcheck.within(parameter.grad, exact, bound, f"{short}: d {what} accumulated over the micro-batches")


# The per-expert MoE is this suite's own module (transformers 5 holds experts fused): no
# transformers class loads it back, so save/load runs on the transformers families.
@pytest.mark.qconform_axes(*WORKLOAD_AXES, model=("llama", "qwen2", "gpt2"))
@pytest.mark.qconform_ci_strength(1)
@pytest.mark.qconform_operation("workload:save-load")
def test_save_and_load(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype):
    """``save_pretrained`` of the quantized model, ``from_pretrained`` of the folder (the
    pre-quantized checkpoint path users load from the hub): the reloaded model's layers
    hold the same bytes, compute the same logits bit for bit, and every call is judged."""
    facet, caps, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype, transformers=True)
    import transformers

    if not any(facet.owns(m) for m in lm.modules()):
        pytest.fail("the model holds no quantized layer of this backend")
    lm.eval()
    ids, mask = prompts((6, 4), seed=503, device=qdevice)
    with torch.no_grad():
        saved_logits = lm(input_ids=ids, attention_mask=mask).logits
    saved_bytes = snapshot_model(facet, lm)
    lm.save_pretrained(tmp_path / "quantized")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", device_map=str(qdevice))
    loaded.eval()
    saved = {name: snapshot(facet, m, computing=True) for name, m in lm.named_modules() if facet.owns(m)}
    reloaded = {name: snapshot(facet, m, computing=True) for name, m in loaded.named_modules() if facet.owns(m)}
    qcheck.equal(sorted(reloaded), sorted(saved), "the reloaded model's quantized layers")
    for name, fields in saved.items():
        changed = snapshot_differences(fields, reloaded[name])
        qcheck.equal(changed, [], f"{name}: stored fields that changed through save and load")
    with qwatch(loaded, {qbackend.name: facet}), torch.no_grad():
        logits = loaded(input_ids=ids, attention_mask=mask).logits
    qcheck.equal(torch.equal(logits, saved_logits), True, "the reloaded model's logits equal the saved model's")
    _check_outside_truth(qcheck, facet, loaded, model, dtype, ids, mask, logits=logits, saved=saved_bytes)


@pytest.mark.qconform_axes(*WORKLOAD_AXES, model=("llama", "qwen2", "gpt2"))
@pytest.mark.qconform_ci_strength(1)
@pytest.mark.qconform_operation("workload:merge")
def test_merge_save_and_load(qtarget, qbackend, qdevice, qcheck, qwatch, tmp_path, spec, model, dtype):
    """An adapter merged for deployment: LoRA on every quantized layer (random adapters),
    ``merge_and_unload`` (PEFT dequantizes, adds ``s B A`` and quantizes again), then
    ``save_pretrained`` -> ``from_pretrained`` where the backend claims transformers. Every
    rebuilt layer must keep its bias (PEFT's rebuild of a quantized layer has dropped it)
    and hold the merged weight quantized to nearest on its grid; the model then computes
    with every call judged, and the reloaded one computes the same logits bit for bit."""
    peft = needs("peft")
    facet, caps, lm = _workload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, model, dtype, peft=True)
    torch.manual_seed(601)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=lora_targets(lm, facet), lora_dropout=0.0, init_lora_weights=False
    )
    lm = peft.get_peft_model(lm, config)
    layers = {name.removeprefix("base_model.model."): m for name, m in lora_layers(lm, facet).items()}
    deltas = {name: lora_delta(module, ALPHA / RANK) for name, module in layers.items()}
    before = {name: facet.packed(module.get_base_layer()) for name, module in layers.items()}
    derived = merge_targets(layers, before, ALPHA / RANK, 1.0)  # what each merged layer must hold
    biases = {name: facet.bias(module.get_base_layer()) for name, module in layers.items()}
    merged = lm.merge_and_unload()
    modules = dict(merged.named_modules())
    for name in layers:
        layer = modules.get(name)
        qcheck.equal(facet.owns(layer), True, f"{name} is a 4-bit layer after merge_and_unload")
        kept, bias = facet.bias(layer), biases[name]
        state = (
            "none" if bias is None else "kept" if kept is not None and torch.equal(kept, bias) else "lost or changed"
        )
        qcheck.equal(state, "none" if bias is None else "kept", f"{name}: its bias after merge_and_unload")
        check_requantized(qcheck, facet, layer, before[name], *deltas[name], 1.0, f"{name}: merged weight")
    merged.eval()
    ids, mask = prompts((5, 3), seed=607, device=qdevice)
    if caps.transformers:
        import transformers

        merged.save_pretrained(tmp_path / "merged")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", device_map=str(qdevice))
        loaded.eval()
    with torch.no_grad():
        logits = merged(input_ids=ids, attention_mask=mask).logits
    if caps.transformers:
        with qwatch(loaded, {qbackend.name: facet}), torch.no_grad():
            reloaded = loaded(input_ids=ids, attention_mask=mask).logits
        qcheck.equal(torch.equal(reloaded, logits), True, "the reloaded merged model's logits equal the merged model's")
    else:
        with qwatch(merged, {qbackend.name: facet}), torch.no_grad():
            merged(input_ids=ids, attention_mask=mask)
    # the requantized bytes decoded, every other tensor from the source (the merge changed none)
    _check_outside_truth(qcheck, facet, merged, model, dtype, ids, mask, logits=logits, derived=derived)

"""The models the workload suite runs, and how each backend's users quantize them.

Each family is built from a transformers config with random weights (no download), two
hidden layers, small enough for a CPU run, with its quirks:

- ``llama``: no bias anywhere;
- ``qwen2``: q/k/v projections with bias;
- ``gpt2``: ``Conv1D`` weights stored (in, out), lm_head tied to the embedding;
- ``moe``: Qwen2-MoE, whose routed experts (3-D parameters in transformers 5, which no
  quantization config quantizes) are held as one quantized linear layer per expert, the
  way MoE models were quantized when experts were modules, and called for every expert:
  0, 1 or many tokens each.

Quantized as the backend's users do it: through ``from_pretrained`` with the backend's
``quantization_config`` where its layer claims transformers (bitsandbytes), else by
replacing each ``nn.Linear`` and ``Conv1D`` (its weight transposed to (out, in), as
transformers' own bitsandbytes integration does) with ``LayerFacet.quantize`` (HQQ, our
Triton layer). The lm_head stays in the model's dtype, as both integrations leave it.
"""

from __future__ import annotations

import torch

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.layers import LayerCapabilities, LayerFacet

from ._layers import needs

VOCAB = 128
PAD = 0  # the pad token id: never drawn as a prompt token
SOURCE_SEED = 211  # the seed of the float checkpoint quantized_model quantizes (its source)


def float_model(family: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    transformers = needs("transformers")
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=128, pad_token_id=PAD)
    llama_like = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2)
    if family == "llama":
        config = transformers.LlamaConfig(**common, **llama_like)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**common, **llama_like)
    elif family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_layer=2, n_embd=64, n_inner=128, n_head=2, n_positions=128, pad_token_id=PAD
        )
    elif family == "moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            **llama_like,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        )
    else:
        raise ValueError(f"unknown workload model family {family!r}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):  # a trained checkpoint's biases are not the zeros transformers initializes
                parameter.normal_(0.0, 0.1)
            elif "mlp" in name and any(part in name for part in ("up_proj", "c_fc", "gate_up")):
                # a pruned neuron and a dead input feature, as real checkpoints have: rows and
                # columns of zeros, whose blocks and groups are constant (max == min)
                parameter[..., 0, :] = 0
                parameter[..., :, 0] = 0
    return model


class PerExpertLinears(torch.nn.Module):
    """Routed experts as a quantized ``gate_up`` and ``down`` layer each, called for every
    expert whatever its token count (0 included), as per-expert MoE blocks did."""

    def __init__(self, experts: torch.nn.Module, quantize) -> None:
        super().__init__()
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn
        self.gate_up = torch.nn.ModuleList(quantize(w) for w in experts.gate_up_proj.detach())
        self.down = torch.nn.ModuleList(quantize(w) for w in experts.down_proj.detach())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            gate, up = self.gate_up[expert](hidden_states[token]).chunk(2, dim=-1)
            routed = self.down[expert](self.act_fn(gate) * up) * top_k_weights[token, slot, None]
            out.index_add_(0, token, routed.to(out.dtype))
        return out


def _replace_linears(model: torch.nn.Module, quantize) -> None:
    from transformers.pytorch_utils import Conv1D

    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            where = f"{prefix}.{name}" if prefix else name
            if name == "lm_head":
                continue
            if type(child) is torch.nn.Linear:
                setattr(module, name, quantize(child.weight.detach(), child.bias, where))
            elif isinstance(child, Conv1D):
                setattr(module, name, quantize(child.weight.detach().T, child.bias, where))


def _replace_experts(model: torch.nn.Module, quantize) -> int:
    replaced = 0
    for prefix, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if getattr(child, "gate_up_proj", None) is not None and child.gate_up_proj.dim() == 3:
                where = f"{prefix}.{name}" if prefix else name
                setattr(module, name, PerExpertLinears(child, lambda w, where=where: quantize(w, None, where)))
                replaced += 1
    return replaced


def quantized_model(
    qcheck,
    facet: LayerFacet,
    caps: LayerCapabilities,
    spec: QuantSpec,
    family: str,
    dtype: torch.dtype,
    device: torch.device,
    tmp_path,
    seed: int = SOURCE_SEED,
    device_map: dict[str, str] | None = None,
) -> torch.nn.Module:
    """``float_model(family)`` quantized by the backend (see the module docstring), on
    ``device``, or split over devices by ``device_map`` (module name prefix -> device, as
    ``from_pretrained(device_map=...)`` takes it): transformers dispatches what it loads, and
    a model quantized by replacing its layers gets each layer quantized on its device and
    the rest dispatched by accelerate (hooks that move activations between the devices)."""

    def quantize(weight: torch.Tensor, bias: torch.Tensor | None, name: str) -> torch.nn.Module:
        on = placed(device_map, name, device)
        return facet.quantize(weight.cpu(), None if bias is None else bias.detach().cpu(), spec, dtype, on)

    model = float_model(family, dtype, seed)
    built = "replacing nn.Linear and Conv1D"
    if caps.transformers:
        import transformers

        model.save_pretrained(tmp_path / "float")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / "float",
                quantization_config=facet.transformers_config(spec, dtype),
                device_map=device_map or str(device),
                dtype=dtype,
            )
            if any(facet.owns(m) for m in model.modules()):
                built = "from_pretrained with its quantization_config"
            else:  # GPT-2 under HqqConfig: its Conv1D layers load as float, silently
                qcheck.describe(transformers_left_float="from_pretrained quantized no layer")
                model = float_model(family, dtype, seed)
        except NotImplementedError as exc:  # transformers refuses the config (HQQ in transformers 5)
            qcheck.describe(transformers_refused=str(exc).splitlines()[0])
    if built != "from_pretrained with its quantization_config":
        model = model.to(device) if device_map is None else model
        _replace_linears(model, quantize)
        facet.mark_quantized(model)
    experts = _replace_experts(model, quantize)
    if device_map is not None and built != "from_pretrained with its quantization_config":
        import accelerate

        model = accelerate.dispatch_model(model, device_map=device_map)
    qcheck.describe(model=family, built_by=built, **({"quantized_expert_blocks": experts} if experts else {}))
    return model


def placed(device_map: dict[str, str] | None, name: str, default: torch.device) -> torch.device:
    """The device ``device_map`` gives module ``name`` (its longest matching prefix), else ``default``."""
    if not device_map:
        return default
    matches = [prefix for prefix in device_map if prefix == "" or name == prefix or name.startswith(prefix + ".")]
    return torch.device(device_map[max(matches, key=len)]) if matches else default


def prompts(lengths: tuple[int, ...], seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of prompts of the given lengths and its attention mask, as a
    tokenizer with ``padding_side="left"`` gives them for generation."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=gen)
        mask[row, width - length :] = 1
    return ids.to(device), mask.to(device)


def check_cache_filled(qcheck, cache, positions: int) -> None:
    """The KV cache a workload passed holds every position the model ran on. A model that
    does not take the keyword the cache came in (transformers 5.24 prefers ``cache=`` and
    plans to remove ``past_key_values=``; a forward with ``**kwargs`` drops a name it does
    not know, and a compiled one does so silently) decodes each step without its context:
    its logits are finite and every layer call is still right, so only the cache shows it."""
    qcheck.equal(
        int(cache.get_seq_length()), positions, "positions held by the KV cache the workload passed (ignored: 0)"
    )


def lora_targets(model: torch.nn.Module, facet: LayerFacet) -> list[str]:
    """The module names (last part) of the quantized layers: what a user lists in
    ``LoraConfig.target_modules`` for this family."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if facet.owns(module)}
    return sorted(name for name in names if not name.isdigit())  # per-expert layers are list items


def lora_layers(model: torch.nn.Module, facet: LayerFacet) -> dict[str, torch.nn.Module]:
    """PEFT's LoRA layers around the backend's quantized layers, by module name."""
    return {
        name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and facet.owns(getattr(m, "base_layer", m))
    }


class LoraCalls:
    """Each LoRA layer's calls in a training step, paired forward to backward: the input
    ``x`` of every forward that records a graph (a reentrant checkpoint's first forward runs
    without grad and records none; its recomputation does), matched last-in first-out with
    the upstream gradient ``dy`` its backward receives. PyTorch hooks that only look."""

    def __init__(self, model: torch.nn.Module, facet: LayerFacet) -> None:
        self.layers = lora_layers(model, facet)
        self._pending: dict[str, list[tuple[torch.Tensor, str]]] = {name: [] for name in self.layers}
        self.calls: dict[str, list[tuple[torch.Tensor, torch.Tensor, str]]] = {name: [] for name in self.layers}
        self._handles = []
        for name, module in self.layers.items():
            self._handles.append(module.register_forward_hook(self._forward(name)))
            self._handles.append(module.register_full_backward_hook(self._backward(name)))

    @staticmethod
    def _autocast(x: torch.Tensor) -> str:
        kind = x.device.type
        return str(torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else ""

    def _forward(self, name: str):
        def hook(module, args, output):
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                self._pending[name].append((args[0].detach().clone(), self._autocast(args[0])))

        return hook

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            x, autocast = self._pending[name].pop()
            self.calls[name].append((x, grad_output[0].detach().clone(), autocast))

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def accumulated_lora_gradients(
    calls: list[tuple[torch.Tensor, torch.Tensor, str]],
    packed,
    w: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    layer_dtype: torch.dtype,
    adapter_dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"lora_A": (exact, bound), "lora_B": ...}`` of the gradients accumulated over a
    step's micro-batches: per call ``_layers.lora_gradients`` in float64 from the call's own
    ``x`` and ``dy`` (the matmuls in the autocast dtype when the call ran under autocast),
    summed, plus one rounding to the parameter's dtype per accumulation."""
    from pytest_qconform.reference import bounds

    from ._layers import lora_gradients

    total: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for x, dy, autocast in calls:
        compute = getattr(torch, autocast.removeprefix("torch.")) if autocast else layer_dtype
        adapter = compute if autocast else adapter_dtype
        k, n = w.shape[1], w.shape[0]
        grads = lora_gradients(
            x.double().reshape(-1, k),
            dy.double().reshape(-1, n),
            w,
            bounds.layer_weight_error(packed, w, layer_dtype),
            lora_a,
            lora_b,
            scale,
            compute,
            adapter,
            x.dtype,
        )
        for key in ("lora_A", "lora_B"):
            exact, bound = grads[key]
            if key in total:
                exact, bound = total[key][0] + exact, total[key][1] + bound
            total[key] = (exact, bound + bounds.rounding_bound(exact.abs() + bound, adapter_dtype))
    return total


def check_first_adamw_step(qcheck, adapters, before, lr: float, eps: float) -> None:
    """AdamW's first step moves each parameter by ``lr g / (|g| + eps)`` (the bias-corrected
    moments of one gradient are ``g`` and ``g^2``), computed in the parameter's dtype with a
    dozen roundings (moments, corrections, square root, division, scaling) and one more
    to subtract: bound ``gamma_12(u) |step| + u |p'|``."""
    from pytest_qconform.reference import bounds

    for name, p in adapters.items():
        p0, g = before[name]
        step = lr * g / (g.abs() + eps)
        exact = p0 - step
        u = bounds.unit_roundoff(p.dtype)
        bound = bounds.gamma(12, u) * step.abs() + u * exact.abs()
        qcheck.within(p.detach(), exact, bound, f"{name}: AdamW's first step from its gradient")

"""Repro of the bitsandbytes provenance known failure (known_failures.toml, "provenance"):
a strict ``load_state_dict`` of a quantized ``Linear4bit``'s own state into another one
raises on the quant-state keys after torch copied the packed bytes in. Prints
``raised True True``: the layer now holds the checkpoint's codes with its own old absmax."""

import bitsandbytes as bnb
import torch


def layer(scale: float) -> torch.nn.Module:
    built = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
    built.weight = bnb.nn.Params4bit(torch.randn(64, 64) * scale, requires_grad=False, quant_type="nf4")
    return built.to("cpu")  # Params4bit.to quantizes


saved, loading = layer(1.0), layer(3.0)
old_absmax = loading.weight.quant_state.absmax.clone()
try:
    torch.nn.Sequential(loading).load_state_dict({"0." + k: v for k, v in saved.state_dict().items()})
except RuntimeError:
    print("raised", end=" ")
print(torch.equal(loading.weight.data, saved.weight.data), torch.equal(loading.weight.quant_state.absmax, old_absmax))

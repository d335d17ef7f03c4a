"""Minimal reproductions of what the layer suites found in bitsandbytes' ``Linear4bit``
(0.50.2), one line of output per finding; run it on the machine in question:

    python bench/diagnose_linear4bit_layer.py

1-3 need a CPU with AVX512-BF16 (bitsandbytes' ``has_avx512bf16()``): there, an
eval-mode forward without grad repacks the weight for a CPU kernel
(``_convert_weight_packed_for_cpu``), keeps absmax as bf16 in a transposed [K/blocksize,
N] layout, and leaves the layer in that state:
  1. an fp32-compute layer computes that forward in bf16 precision;
  2. a training forward afterwards (train mode, grad on) takes the inference-only packed
     path and raises on the bias add;
  3. ``state_dict()`` afterwards writes absmax still transposed and in bf16 (plain) or
     double-quantized again from the bf16 values (double quant), so a checkpoint saved
     after evaluating the model decodes to other weights.
4 and 5 hold on any device:
  4. a forward casts the layer's bias parameter in place to the compute dtype;
  5. ``load_state_dict(strict=False)`` into a quantized layer copies the packed bytes and
     drops absmax and the quant state (reported only as unexpected keys), so the layer
     decodes the checkpoint's codes with its own old scales.
"""

from __future__ import annotations

import torch
from bitsandbytes.functional import dequantize_4bit, has_avx512bf16
from bitsandbytes.nn import Linear4bit, Params4bit


def layer(seed: int, compute_dtype: torch.dtype, bias: bool = False, device: str = "cpu") -> Linear4bit:
    torch.manual_seed(seed)
    module = Linear4bit(
        128, 64, bias=bias, compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=False, device="meta"
    )
    module.weight = Params4bit(
        torch.randn(64, 128) * torch.rand(64, 1) * 4,
        requires_grad=False,
        quant_type="nf4",
        compress_statistics=False,
        module=module,
    )
    if bias:
        module.bias = torch.nn.Parameter(torch.randn(64))
    return module.to(device)


def decoded(module: Linear4bit) -> torch.Tensor:
    return dequantize_4bit(module.weight.data, module.weight.quant_state).double()


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, has_avx512bf16() = {has_avx512bf16()}")
    x = torch.randn(4, 128)

    m = layer(0, torch.float32).eval()
    w = decoded(m)
    with torch.no_grad():
        y = m(x)
    rel = ((y.double() - x.double() @ w.T).abs().max() / (x.double() @ w.T).abs().max()).item()
    print(f"1. fp32 layer, eval no-grad forward: relative error {rel:.1e} (fp32 arithmetic gives ~1e-7)")

    m = layer(1, torch.bfloat16, bias=True).eval()
    with torch.no_grad():
        m(x.bfloat16())
    try:
        m.train()(x.bfloat16().requires_grad_(True)).sum().backward()
        print("2. training forward after an eval forward: ran")
    except RuntimeError as exc:
        print(f"2. training forward after an eval forward: RuntimeError: {exc}")

    m = layer(2, torch.bfloat16).eval()
    w = decoded(m)
    with torch.no_grad():
        m(x.bfloat16())
    saved = m.state_dict()
    fresh = Params4bit.from_prequantized(
        saved["weight"], {k[7:]: v for k, v in saved.items() if k != "weight"}, device="cpu"
    )
    print(
        f"3. checkpoint saved after an eval forward: weight.absmax {list(saved['weight.absmax'].shape)} "
        f"{saved['weight.absmax'].dtype}, max |reloaded - original| = "
        f"{(dequantize_4bit(fresh.data, fresh.quant_state).double() - w).abs().max().item():.3g}"
    )

    m = layer(3, torch.bfloat16, bias=True, device=device)
    before = m.bias.dtype
    m(x.bfloat16().to(device))
    print(f"4. bias dtype before a bf16-compute forward: {before}, after: {m.bias.dtype}")

    saved, other = layer(4, torch.bfloat16, device=device), layer(5, torch.bfloat16, device=device)
    result = other.load_state_dict(saved.state_dict(), strict=False)
    print(
        f"5. load_state_dict(strict=False): max |loaded - saved| = "
        f"{(decoded(other) - decoded(saved)).abs().max().item():.3g}; unexpected keys {result.unexpected_keys}"
    )


if __name__ == "__main__":
    main()

"""bitsandbytes' 4-bit code tables and its double quantization of absmax, in plain PyTorch.

The wing's 4-bit codes come from its own kernel (``kernels.nf4_quantize``); these are the
tables it quantizes with and the nesting of absmax, on the same device. Double quantization
mirrors bitsandbytes 0.50.2: subtract the mean absmax and quantize the rest with the signed
8-bit dynamic map in blocks of 256.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# bitsandbytes' own tables (functional.get_4bit_type), index = the stored 4-bit code.
NF4_CODE: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
FP4_CODE: tuple[float, ...] = tuple(
    v / 12.0 for v in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
)
NESTED_BLOCKSIZE = 256


def code_table(quant_type: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32[16] code table of ``quant_type`` ("nf4" or "fp4")."""
    if quant_type not in ("nf4", "fp4"):
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    return torch.tensor(NF4_CODE if quant_type == "nf4" else FP4_CODE, dtype=torch.float32, device=device)


def dynamic_map_signed(device: torch.device | str = "cpu") -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)``:
    the float32[256] map double quantization stores absmax codes into."""
    data: list[float] = []
    max_exponent_bits, non_sign_bits = 7, 7
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(max_exponent_bits - 1) + i)
        data += (scale * means).tolist()
        data += (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    data.sort()
    return torch.tensor(data, dtype=torch.float32, device=device)


def blockwise_absmax(flat: torch.Tensor, blocksize: int) -> torch.Tensor:
    """fp32 max |x| per block of ``blocksize`` (the last block may be partial)."""
    pad = (-flat.numel()) % blocksize
    padded = F.pad(flat, (0, pad)) if pad else flat
    return padded.reshape(-1, blocksize).abs().amax(dim=1)


def nearest_code(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """uint8 index of the nearest table entry to each value (ties to the lower index)."""
    out = torch.empty(values.shape, dtype=torch.uint8, device=values.device)
    for start in range(0, values.numel(), 1 << 16):  # bounded [chunk, len(table)] temporaries
        chunk = values[start : start + (1 << 16)]
        out[start : start + chunk.numel()] = (chunk.unsqueeze(-1) - table).abs().argmin(dim=-1).to(torch.uint8)
    return out


def scale_by_block(flat: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """``flat / absmax[block]`` in fp32, 0 where the block is all zero."""
    scale = absmax.repeat_interleave(blocksize)[: flat.numel()]
    return torch.where(scale > 0, flat / torch.where(scale > 0, scale, torch.ones_like(scale)), torch.zeros_like(flat))


def nest_absmax(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Double quantization of fp32 ``absmax`` as bitsandbytes does it.

    Returns (uint8 codes, nested_absmax float32, nested_code float32[256], offset) with
    ``absmax ~= nested_code[codes] * nested_absmax[i // 256] + offset``.
    """
    # The mean in float64, rounded once: an fp32 sum of absmax values near fp32's largest
    # overflows to inf, and an inf offset decodes every block to inf or NaN.
    offset = absmax.double().mean().float()
    centered = absmax.float() - offset
    nested_absmax = blockwise_absmax(centered, NESTED_BLOCKSIZE)
    nested_code = dynamic_map_signed(absmax.device)
    codes = nearest_code(scale_by_block(centered, nested_absmax, NESTED_BLOCKSIZE), nested_code)
    return codes, nested_absmax, nested_code, float(offset)

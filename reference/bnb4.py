"""bitsandbytes-layout 4-bit blockwise formats (NF4, FP4): unpack, decode, quantize.

Layout (bitsandbytes ``quantize_4bit``): the weight is flattened in C order and cut into
blocks of ``blocksize`` consecutive elements (the last block may be partial). Block ``b``
stores ``absmax[b] = max |w|`` over the block; element ``i`` stores a 4-bit code ``c_i``
and decodes as

    w_i = table[c_i] * absmax[i // blocksize]

Two codes share a byte: element ``2j`` is in the HIGH nibble of byte ``j`` and element
``2j + 1`` in the low nibble (``packed = (q[::2] << 4) | q[1::2]`` in bitsandbytes'
default backend; ``out_dq[::2] = A >> 4`` when it unpacks). An odd ``numel`` leaves the
low nibble of the last byte as padding.

Double quantization (``compress_statistics=True``) stores absmax itself in 8 bits:
``offset = mean(absmax)``, then ``absmax - offset`` is blockwise quantized with the signed
dynamic map in blocks of ``nested_blocksize`` (256), so

    absmax[b] = nested_code[absmax_code[b]] * nested_absmax[b // nested_blocksize] + offset

bitsandbytes evaluates both formulas in float32 (``dequantize_blockwise`` to float32,
``absmax += offset``, then ``code * absmax`` in float32; the CUDA and CPU kernels the
same). The reference evaluates them exactly, in float64, from the stored float32 values
(each product and sum of two float32 values here is exact or within 2**-53 relative);
what float32 costs a backend is accounted for in ``bounds.dequantize_bound``.

Every decoding reads the 4-bit values from the format's own table (``formats``), not
from the table the backend carries in ``PackedBnb4.code``: a backend decoding with a
wrong table must show up as a mismatch. The nested table is data of the state
(``state2.code``, any 256-entry map may be used), so it is read from the record.
"""

from __future__ import annotations

import numpy as np
import torch
from pytest_qconform.reference.formats import FP4_SIGN_BIT, code_table
from pytest_qconform.reference.packed import PackedBnb4

__all__ = [
    "code_table",
    "code_values",
    "decode",
    "decode_absmax",
    "encode",
    "half_gaps",
    "nested_absmax_bound",
    "pack_codes",
    "per_block_and_code",
    "quantize",
    "unpack_codes",
]


def _device(device: str | torch.device | None) -> torch.device:
    return torch.device("cpu" if device is None else device)


def _as_bytes(packed: np.ndarray) -> np.ndarray:
    """The packed array as flat uint8 bytes (bitsandbytes may store them viewed as
    another ``quant_storage`` dtype; the bytes are the same)."""
    array = np.ascontiguousarray(np.asarray(packed))
    if array.dtype != np.uint8:
        array = array.view(np.uint8)
    return array.reshape(-1)


def unpack_codes(packed: np.ndarray, numel: int) -> np.ndarray:
    """The 4-bit codes of the first ``numel`` elements, as uint8 in 0..15.

    Element ``2j`` is the HIGH nibble of byte ``j`` and element ``2j + 1`` the low
    nibble (verified against bitsandbytes 0.50.2 on CPU; the CUDA kernels pack the same
    way). The low nibble of the last byte is padding when ``numel`` is odd.
    """
    data = _as_bytes(packed)
    need = (numel + 1) // 2
    if numel < 0 or data.size < need:
        raise ValueError(
            f"unpack_codes: {data.size} packed bytes cannot hold {numel} 4-bit codes "
            f"(need ceil(numel / 2) = {need}); pass the numel of the logical shape"
        )
    data = data[:need]
    codes = np.empty(2 * need, dtype=np.uint8)
    codes[0::2] = data >> 4
    codes[1::2] = data & 0x0F
    return codes[:numel]


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Pack 4-bit codes two per byte, the first of each pair in the HIGH nibble
    (the inverse of ``unpack_codes``; an odd count pads the last low nibble with 0)."""
    flat = np.asarray(codes).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() > 15):
        raise ValueError(f"pack_codes: codes must be in 0..15, got range [{flat.min()}, {flat.max()}]")
    flat = flat.astype(np.uint8)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, dtype=np.uint8)])
    return ((flat[0::2] << 4) | flat[1::2]).astype(np.uint8)


def code_values(codes: np.ndarray, quant_type: str, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """``table[codes]`` in float64: what each code means. Compare codes by value, not by
    index: FP4 has two zeros (codes 0 and 8) that decode identically."""
    table = torch.tensor(code_table(quant_type), dtype=torch.float64, device=_device(device))
    index = torch.as_tensor(np.asarray(codes, dtype=np.int64), device=table.device)
    return table[index]


def _nblocks(numel: int, blocksize: int) -> int:
    return -(-numel // blocksize)


_U32 = 2.0**-24  # fp32's unit roundoff (reference.bounds imports this module)


def half_gaps(table: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Half the width of the code interval each scaled value falls into."""
    codes = torch.sort(table).values
    gaps = torch.diff(codes)
    idx = torch.searchsorted(codes, scaled.clamp(codes[0], codes[-1]).contiguous()).clamp(1, len(codes) - 1)
    return gaps[idx - 1] / 2


def nested_absmax_bound(
    nested: torch.Tensor, nested_map: torch.Tensor, normalized: torch.Tensor, absmax: torch.Tensor
) -> torch.Tensor:
    """How far a double-quantized absmax may decode from the block's ``absmax`` (float64, per
    block): ``absmax - offset`` normalized by its group's ``nested`` absmax went through the
    8-bit map, whose code is one of the two around the value (bitsandbytes' search need not
    pick the nearest), so within the full gap of that interval times ``nested``, plus fp32
    roundings of the decode."""
    return nested * 2 * half_gaps(nested_map, normalized) + 4 * _U32 * absmax.abs()


def decode_absmax(p: PackedBnb4, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """Per-block absmax in float64, ``[nblocks]``.

    Plain: the stored float32 absmax. Double quantized:
    ``nested_code[absmax_code[b]] * nested_absmax[b // nested_blocksize] + offset``, which
    bitsandbytes computes in float32 (two roundings) and the reference exactly.
    """
    dev = _device(device)
    nblocks = _nblocks(p.numel, p.blocksize)
    absmax = np.asarray(p.absmax).reshape(-1)
    if absmax.size != nblocks:
        raise ValueError(
            f"decode_absmax: {absmax.size} absmax entries for shape {p.shape} in blocks of "
            f"{p.blocksize} (expected ceil({p.numel} / {p.blocksize}) = {nblocks})"
        )
    if not p.double_quant:
        return torch.as_tensor(absmax.astype(np.float64), device=dev)
    if p.nested_code is None or p.nested_blocksize is None or p.offset is None:
        raise ValueError(
            "decode_absmax: a double-quantized PackedBnb4 needs nested_code, nested_blocksize "
            "and offset besides nested_absmax (state2.code, state2.blocksize, state.offset)"
        )
    if absmax.dtype != np.uint8:
        raise ValueError(f"decode_absmax: double-quantized absmax must be uint8 codes, got {absmax.dtype}")
    nested_code = np.asarray(p.nested_code, dtype=np.float64).reshape(-1)
    nested_absmax = np.asarray(p.nested_absmax, dtype=np.float64).reshape(-1)
    n_nested = _nblocks(nblocks, p.nested_blocksize)
    if nested_code.size != 256 or nested_absmax.size != n_nested:
        raise ValueError(
            f"decode_absmax: expected a 256-entry nested_code and ceil({nblocks} / "
            f"{p.nested_blocksize}) = {n_nested} nested_absmax entries, got {nested_code.size} "
            f"and {nested_absmax.size}"
        )
    code = torch.as_tensor(nested_code, device=dev)[torch.as_tensor(absmax.astype(np.int64), device=dev)]
    scale = torch.as_tensor(nested_absmax, device=dev).repeat_interleave(p.nested_blocksize)[:nblocks]
    return code * scale + float(p.offset)


def per_block_and_code(p: PackedBnb4, table: torch.Tensor) -> torch.Tensor:
    """Each element's entry of ``table`` (``[nblocks, 16]``: a value for every block and
    code), shape ``p.shape``: ``table[i // blocksize, code_i]``.

    Whatever is computed elementwise from an element's code and its block's absmax (the
    decoding, its error bounds) takes one of ``16 * nblocks`` values, so it is computed
    on that table and read out per element in one pass."""
    numel, blocksize = p.numel, p.blocksize
    nblocks = _nblocks(numel, blocksize)
    if tuple(table.shape) != (nblocks, 16):
        raise ValueError(f"per_block_and_code: table of shape {tuple(table.shape)}, expected ({nblocks}, 16)")
    codes = unpack_codes(p.packed, numel)
    if numel % blocksize:
        codes = np.concatenate([codes, np.zeros(nblocks * blocksize - numel, dtype=np.uint8)])
    index = torch.as_tensor(codes, device=table.device).reshape(nblocks, blocksize).long()
    return torch.gather(table, 1, index).reshape(-1)[:numel].reshape(p.shape)


def decode(p: PackedBnb4, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """The weight in float64, shape ``p.shape``: ``table[code_i] * absmax[i // blocksize]``
    over the flattened tensor (partial last block and odd numel included)."""
    if p.blocksize <= 0:
        raise ValueError(f"decode: blocksize must be positive, got {p.blocksize}")
    dev = _device(device)
    table = torch.tensor(code_table(p.quant_type), dtype=torch.float64, device=dev)
    return per_block_and_code(p, decode_absmax(p, dev).unsqueeze(1) * table)


def _sorted_table(quant_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct table values ascending, and for each the code it quantizes to
    (for FP4's two zeros, +0 = code 0; the sign is applied by the caller)."""
    table = code_table(quant_type)
    order = sorted(range(16), key=lambda c: (table[c], c))
    values: list[float] = []
    codes: list[int] = []
    for c in order:
        if values and table[c] == values[-1]:
            continue
        values.append(table[c])
        codes.append(c)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes, dtype=torch.int64)


def quantize(weight: torch.Tensor, quant_type: str, blocksize: int) -> tuple[np.ndarray, torch.Tensor]:
    """Reference quantizer: ``(codes uint8 [numel], absmax float64 [nblocks])``.

    ``absmax[b] = max |w|`` over block ``b`` of the flattened weight (exact), each element
    is scaled exactly, ``s = w / absmax`` (0 in an all-zero block), and gets the code of
    the nearest table value. Tie rule: a value exactly on the midpoint of two adjacent
    table values takes the LOWER value. That is what bitsandbytes' CPU/default quantizer
    does (``torch.bucketize(scaled, midpoints)``, right=False) and its CUDA NF4 kernel
    (``x > threshold`` picks the upper code); its CUDA FP4 kernel compares ``|x|`` and so
    rounds a negative tie toward zero. bitsandbytes scales in float32 by a reciprocal
    (``w * (1 / absmax)``; the partial last block divides) and compares against float32
    midpoints (CUDA: decimal literals rounded to float32), so elements within a few
    float32 ulps of a midpoint may legitimately go either way: callers exclude them.

    FP4 zero: the sign bit follows the value's sign (``x < 0`` -> code 8, "-0"; else code
    0), as bitsandbytes' CUDA ``dQuantizeFP4`` does. bitsandbytes' CPU path instead gives
    small positive values code 8 and small negative ones code 0 (an artifact of
    ``argsort`` over the table's two zeros); both decode to 0, so compare codes by value
    (``code_values``), not by index.

    absmax differs from bitsandbytes only for an all-zero partial last block, where
    bitsandbytes stores ``1e-38`` (its clamp) and the reference 0; both decode to zeros.
    """
    if blocksize <= 0:
        raise ValueError(f"quantize: blocksize must be positive, got {blocksize}")
    w = weight.detach().to(torch.float64).reshape(-1)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize: the weight has NaN or Inf entries; the 4-bit formats have no code for them")
    numel = w.numel()
    nblocks = _nblocks(numel, blocksize)
    padded = torch.zeros(nblocks * blocksize, dtype=torch.float64, device=w.device)
    padded[:numel] = w
    absmax = padded.reshape(nblocks, blocksize).abs().amax(dim=1)
    block_absmax = absmax.repeat_interleave(blocksize)[:numel]
    scaled = torch.where(block_absmax > 0, w / torch.where(block_absmax > 0, block_absmax, 1.0), torch.zeros_like(w))
    values, value_codes = _sorted_table(quant_type)
    values, value_codes = values.to(w.device), value_codes.to(w.device)
    midpoints = (values[1:] + values[:-1]) / 2
    # searchsorted(right=False) counts midpoints strictly below s: a tie goes to the lower value.
    codes = value_codes[torch.searchsorted(midpoints, scaled.contiguous(), right=False)]
    if quant_type == "fp4":
        negative_zero = (codes == 0) & (scaled < 0)
        codes = torch.where(negative_zero, torch.full_like(codes, FP4_SIGN_BIT), codes)
    return codes.to(torch.uint8).cpu().numpy(), absmax


def encode(weight: torch.Tensor, quant_type: str, blocksize: int) -> PackedBnb4:
    """``quantize`` then pack into a ``PackedBnb4`` (no double quantization; absmax stored
    as float32, the table as the format's float32 table)."""
    codes, absmax = quantize(weight, quant_type, blocksize)
    return PackedBnb4(
        quant_type=quant_type,
        blocksize=blocksize,
        shape=tuple(int(n) for n in weight.shape),
        packed=pack_codes(codes),
        absmax=absmax.cpu().numpy().astype(np.float32),
        code=np.asarray(code_table(quant_type), dtype=np.float32),
        dtype=str(weight.dtype).removeprefix("torch."),
    )

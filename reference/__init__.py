"""The float64 reference: formats, decoding, the linear layer and error bounds.

Written from the formats' definitions (bitsandbytes NF4/FP4 blockwise with optional
double quantization, HQQ 4-bit affine), importing no backend. It decodes a backend's own
packed bytes (``packed.PackedBnb4`` / ``packed.PackedHqq4``) exactly, in float64 torch
tensors on any device, and bounds how far a backend's float result may conformantly be
from it (``bounds``: derived from the arithmetic, no tuned tolerances).

Public, stable API (downstream conformance tests call it directly):

- ``formats``: ``NF4_CODE``, ``FP4_CODE``, ``code_table``, ``dynamic_map_signed``
- ``bnb4``: ``unpack_codes``, ``pack_codes``, ``code_values``, ``decode_absmax``,
  ``decode``, ``quantize``, ``encode``
- ``hqq4``: ``unpack_4bit_u8``, ``grouped_shape``, ``decode``
- ``gemlite4``: ``unpack_over_cols``, ``decode``, ``decode_parts``, ``hqq_parts`` (an HQQ layer
  converted by gemlite)
- ``linear``: ``linear``, ``linear_backward``
- ``requantize``: ``grid_values``, ``nearest_distance``, ``requantize_bound`` (a weight
  quantized again from a float target, as PEFT's LoRA merge does)
- ``bounds``: ``BOUND_MULTIPLE``, ``unit_roundoff``, ``gamma``, ``rounding_bound``,
  ``dequantize_bound``, ``bnb4_dequantize_bound``, ``gemlite4_dequantize_bound``, ``matmul_bound``, ``grad_bound``,
  ``error_multiple``

Usage::

    from pytest_qconform.reference import bnb4, bounds
    exact = bnb4.decode(packed)                       # float64, packed.shape
    bound = bounds.bnb4_dequantize_bound(packed, torch.bfloat16)
    assert bounds.error_multiple(out, exact, bound) <= bounds.BOUND_MULTIPLE
"""

from __future__ import annotations

from pytest_qconform.reference import bnb4, bounds, formats, gemlite4, hqq4, linear, requantize
from pytest_qconform.reference.bounds import (
    BOUND_MULTIPLE,
    bnb4_dequantize_bound,
    dequantize_bound,
    error_multiple,
    gamma,
    grad_bound,
    matmul_bound,
    rounding_bound,
    unit_roundoff,
)
from pytest_qconform.reference.formats import FP4_CODE, NF4_CODE, code_table, dynamic_map_signed
from pytest_qconform.reference.linear import linear_backward
from pytest_qconform.reference.packed import PackedBnb4, PackedGemlite4, PackedHqq4

__all__ = [
    "BOUND_MULTIPLE",
    "FP4_CODE",
    "NF4_CODE",
    "PackedBnb4",
    "PackedGemlite4",
    "PackedHqq4",
    "bnb4",
    "bnb4_dequantize_bound",
    "bounds",
    "code_table",
    "dequantize_bound",
    "dynamic_map_signed",
    "error_multiple",
    "formats",
    "gamma",
    "gemlite4",
    "grad_bound",
    "hqq4",
    "linear",
    "linear_backward",
    "matmul_bound",
    "requantize",
    "rounding_bound",
    "unit_roundoff",
]

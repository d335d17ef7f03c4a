"""Our Triton quantize kernel (``kernels.nf4_quantize``) against the reference quantizer, byte for byte.

The kernel must give exactly the reference's codes and absmax: ties on a midpoint go to the
lower value, an all-zero block stores absmax 0 and the code of 0, FP4 keeps the sign of a
negative value rounding to zero, and subnormal or near-fp32-max blocks stay exact. On a
machine without CUDA it runs in Triton's interpreter (set before triton is imported).
"""

from __future__ import annotations

import ast
import inspect
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from hypothesis import example, given, settings
from hypothesis import strategies as st
from pytest_qconform.reference import bnb4

from qconform_triton_nf4 import backend as triton_nf4
from qconform_triton_nf4 import double_quant
from qconform_triton_nf4.kernels.nf4_quantize import code_boundaries, quantize_4bit

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FORMATS = ("nf4", "fp4")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize(weight: torch.Tensor, quant_type: str, blocksize: int) -> tuple[np.ndarray, np.ndarray]:
    boundaries = code_boundaries(double_quant.code_table(quant_type))
    packed, absmax = quantize_4bit(weight.to(DEVICE), blocksize=blocksize, boundaries=boundaries)
    return packed.cpu().numpy(), absmax.cpu().numpy()


def assert_matches_reference(weight: torch.Tensor, quant_type: str, blocksize: int) -> None:
    packed, absmax = quantize(weight, quant_type, blocksize)
    ref = bnb4.encode(weight.cpu(), quant_type, blocksize)
    np.testing.assert_array_equal(absmax, ref.absmax, err_msg="absmax")
    if not np.array_equal(packed, ref.packed):
        numel = weight.numel()
        got, want = bnb4.unpack_codes(packed, numel), bnb4.unpack_codes(ref.packed, numel)
        i = int(np.flatnonzero(got != want)[0])
        raise AssertionError(
            f"{quant_type} b{blocksize}: code of element {i} (w={weight.reshape(-1)[i].item()!r}) "
            f"is {got[i]}, the reference's {want[i]}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quant_type", FORMATS)
@pytest.mark.parametrize("shape", [(3, 66), (257, 66), (1,), (7, 9), (64, 256)], ids=str)
def test_codes_and_absmax_equal_the_reference(quant_type, dtype, shape):
    """Partial last blocks, odd numel (a padding nibble), a single element, several programs."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert_matches_reference(weight, quant_type, 64)


@pytest.mark.parametrize("blocksize", [32, 128, 256, 1024, 4096])
def test_every_supported_blocksize(blocksize):
    weight = torch.randn(3, blocksize + 2, generator=torch.Generator().manual_seed(blocksize))
    for quant_type in FORMATS:
        assert_matches_reference(weight, quant_type, blocksize)


@pytest.mark.parametrize("quant_type", FORMATS)
def test_ties_go_to_the_lower_value(quant_type):
    """Every midpoint that fp32 holds exactly, at absmax 1, and one ulp either side of it."""
    boundaries = code_boundaries(double_quant.code_table(quant_type))
    values = []
    for m in boundaries.midpoints.tolist():
        m32 = torch.tensor(m, dtype=torch.float32)
        if float(m32) == m:
            values += [m32, torch.nextafter(m32, torch.tensor(2.0)), torch.nextafter(m32, torch.tensor(-2.0))]
    assert len(values) >= 3, "no exactly representable midpoint to test"
    block = torch.zeros(64)
    block[0] = 1.0
    block[1 : 1 + len(values)] = torch.stack(values)
    assert_matches_reference(block, quant_type, 64)


@pytest.mark.parametrize("quant_type", FORMATS)
@pytest.mark.parametrize("absmax", [1.0, 0.7310585975646973, 3.0e-39, 1.4e-45 * 37, 2.9e38], ids=str)
def test_fp32_neighbours_of_every_boundary(quant_type, absmax):
    """At any absmax (normal, subnormal, near fp32's largest), the fp32 values nearest below
    and above each exact boundary ``m * absmax``, and their neighbours, get the reference's code."""
    boundaries = code_boundaries(double_quant.code_table(quant_type))
    top = torch.tensor(absmax, dtype=torch.float32)
    values = [top]
    for m in boundaries.midpoints.tolist():
        exact = m * float(top)  # exact in float64
        nearest = torch.tensor(exact, dtype=torch.float32)
        for v in (nearest, torch.nextafter(nearest, torch.tensor(-3e38)), torch.nextafter(nearest, torch.tensor(3e38))):
            values += [v, torch.nextafter(v, torch.tensor(0.0))]
    weight = torch.stack(values).clamp(-float(top), float(top))
    assert weight.numel() <= 128  # one block: its absmax is ``top``
    assert_matches_reference(weight, quant_type, 128)


@pytest.mark.parametrize("quant_type", FORMATS)
def test_zero_subnormal_and_near_max_blocks_are_exact(quant_type):
    """An all-zero block (absmax 0), a block of fp32 subnormals, one near fp32's largest
    value, and FP4's negative zeros (tiny negative values)."""
    gen = torch.Generator().manual_seed(1)
    tiny = torch.randn(64, generator=gen) * 1e-41  # subnormal fp32
    huge = torch.randn(64, generator=gen).clamp(-1, 1) * 3.0e38
    negative_small = torch.full((64,), -1e-3)
    negative_small[0] = 1.0
    weight = torch.cat([torch.zeros(64), tiny, huge, negative_small, -torch.zeros(64)])
    assert_matches_reference(weight, quant_type, 64)
    _, absmax = quantize(weight, quant_type, 64)
    assert np.isfinite(absmax).all()


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weight_is_refused_naming_the_block(poison):
    weight = torch.randn(4, 64)
    weight[2, 5] = poison
    with pytest.raises(ValueError, match="NaN or Inf entries.*block 2"):
        quantize(weight, "nf4", 64)


def test_strided_weight_is_read_in_logical_order():
    base = torch.randn(96, 64, generator=torch.Generator().manual_seed(2))
    for view in (base.t(), base[::2], base[:, 1:63]):
        assert_matches_reference(view, "nf4", 64)


@settings(max_examples=25, deadline=None)
# Triton's interpreter flushed bf16 subnormals when converting them to fp32 (absmax 0).
@example(quant_type="nf4", dtype=torch.bfloat16, numel=1, scale=1e-40, seed=0)
@given(
    quant_type=st.sampled_from(FORMATS),
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(1, 700),
    scale=st.sampled_from([1e-40, 1e-3, 1.0, 1e30]),
    seed=st.integers(0, 2**16),
)
def test_any_weight_matches_the_reference(quant_type, dtype, numel, scale, seed):
    weight = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))  # fp16 overflow at 1e30
    assert_matches_reference(weight, quant_type, 64)


def test_adapter_does_not_reach_the_reference_quantizer():
    """The backend quantizes with the kernel: its module imports nothing of ``reference.bnb4``
    (a quantize check would otherwise compare the reference with itself)."""
    tree = ast.parse(inspect.getsource(triton_nf4))
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if name and name.startswith("pytest_qconform.reference.bnb4")], imported
    assert "encode" not in vars(triton_nf4), "the adapter holds a reference encode"


def test_the_tables_and_the_nested_map_are_bitsandbytes_own():
    """The tables the adapter quantizes with, and the map it nests absmax into, are bitsandbytes'."""
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    for quant_type in ("nf4", "fp4"):
        assert torch.equal(double_quant.code_table(quant_type), bnb_f.get_4bit_type(quant_type, device="cpu"))
    assert torch.equal(double_quant.dynamic_map_signed(), bnb_f.create_dynamic_map(signed=True))

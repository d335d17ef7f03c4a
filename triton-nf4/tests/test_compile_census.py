"""bench/compile_census.py, the census of Triton kernel variants, run here under the
interpreter: it keys launches the way Triton would on a GPU, so it shows that lengths and
batch sizes (``do_not_specialize``) make no new variant while dtypes do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("bitsandbytes")

BENCH = Path(__file__).resolve().parents[1] / "bench"

LAUNCHES = """
import torch
import bitsandbytes.functional as F
from qconform_triton_nf4 import kernels


def packed(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    data, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    return data, state.absmax, dict(blocksize=64, code=state.code)


def test_lengths_and_batches():
    # dequantize: lengths of every integer class (numel, blocks): (64, 1), (129, 3), (2048, 32)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 64), (3, 43), (2, 1024)):
            data, absmax, kw = packed(shape)
            kernels.dequantize_4bit(data, absmax, shape=shape, out_dtype=dtype, **kw)
    # gemv: K = 45 (elementwise kernel) and 512 (word kernel, fp32 x), N 1 and 17, 1 and 2 rows
    for K in (45, 512):
        for N in (1, 17):
            data, absmax, kw = packed((N, K))
            for rows in (1, 2):
                kernels.gemv_4bit(torch.randn(rows, K), data, absmax, shape=(N, K), **kw)
"""


def test_census_merges_lengths_and_batches_and_splits_dtypes(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p))
    pytester.makepyfile(test_launches=LAUNCHES)
    result = pytester.runpytest_subprocess(
        "-p", "compile_census", "--census-out", "census.json", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*compile census*", "_dequantize_4bit_kernel: 2 distinct keys launched"])
    census = json.loads((pytester.path / "census.json").read_text())
    assert census["mode"] == "interpreted"
    assert census["launches"] == 6 + 8
    # Two output dtypes: two dequantize variants; every length, batch and width: one each.
    assert census["launch_keys"] == {
        "_dequantize_4bit_kernel": 2,
        "_gemv_4bit_kernel": 1,
        "_gemv_4bit_words_kernel": 1,
    }

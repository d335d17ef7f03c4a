"""qconform_triton_nf4.kernel_calls: the warm-up's log of kernel entry-point calls. A replayed call must
reach the same kernel launches as the logged one (same shapes, strides, dtypes and
alignment), a broken log must be refused with its file named, and a failing call must not
stop a replay. Runs under Triton's interpreter here (no GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

from qconform_triton_nf4 import (
    double_quant,  # noqa: E402
    kernel_calls,  # noqa: E402
    kernels,  # noqa: E402  (after TRITON_INTERPRET)
)

BENCH = Path(__file__).resolve().parents[1] / "bench"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr() % 16


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(40, dtype=torch.uint8)[3:],  # odd byte offset
        lambda: torch.zeros(3, 64, dtype=torch.bfloat16)[:, 4:12],  # row stride 64, 8-byte offset
        lambda: torch.zeros(8, 6, dtype=torch.float32).t(),  # transposed
        lambda: torch.zeros(0, 5, dtype=torch.float16),  # empty
        lambda: torch.zeros((), dtype=torch.float32),  # 0-dim (an offset given as a tensor)
    ],
    ids=["uint8-offset-3", "bf16-strided-rows", "fp32-transposed", "empty", "0-dim"],
)
def test_tensor_round_trips_with_shape_strides_dtype_and_alignment(make) -> None:
    tensor = make()
    rebuilt = kernel_calls.decode(json.loads(json.dumps(kernel_calls.encode(tensor))), torch.device("cpu"))
    assert _meta(rebuilt) == _meta(tensor)


def test_other_arguments_round_trip_and_float_values_are_not_logged() -> None:
    args = (None, True, 3, 2.5, "nf4", torch.bfloat16, (4, 64, 0.25))
    rebuilt = tuple(kernel_calls.decode(json.loads(json.dumps(kernel_calls.encode(a))), DEVICE) for a in args)
    assert rebuilt == (None, True, 3, 0.0, "nf4", torch.bfloat16, (4, 64, 0.0))
    assert isinstance(rebuilt[2], int) and isinstance(rebuilt[3], float)


def test_an_unloggable_argument_is_named() -> None:
    with pytest.raises(TypeError, match="cannot log an argument of type object"):
        kernel_calls.encode(object())


def _packed(shape: tuple[int, int], double_quant: bool = False):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    data, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    kwargs = dict(blocksize=64, shape=shape, code=state.code.to(DEVICE))
    if double_quant:
        kwargs.update(
            nested_absmax=state.state2.absmax.to(DEVICE),
            nested_code=state.state2.code.to(DEVICE),
            offset=float(state.offset),
        )
    return data.to(DEVICE), state.absmax.to(DEVICE), kwargs


def test_recorder_logs_each_distinct_call_once_and_restores_the_entry_points() -> None:
    from qconform_triton_nf4.kernels import weight_buffer

    def entry_points():
        return (
            kernels.dequantize_4bit,
            kernels.gemv_4bit,
            weight_buffer.dequantize_4bit,
            kernels.quantize_4bit,
            kernels.tc_gemm_4bit_plan,
        )

    originals = entry_points()
    data, absmax, kw = _packed((8, 128), double_quant=True)
    x = torch.randn(2, 128).to(DEVICE, torch.bfloat16)
    boundaries = kernels.code_boundaries(kw["code"])
    with kernel_calls.Recorder() as recorder:
        for _ in range(2):  # the second round repeats every call: logged once
            kernels.dequantize_4bit(data, absmax, out_dtype=torch.float16, **kw)
            kernels.gemv_4bit(x, data, absmax, **kw)
            kernels.WeightBuffer().dequantize(data, absmax, out_dtype=torch.float32, **kw)
            kernels.quantize_4bit(x, blocksize=64, boundaries=boundaries)  # as the backend quantizes
            kernels.tc_gemm_4bit_plan(x, data, absmax, **kw)  # as plans.linear_plan routes past 32 rows
    assert entry_points() == originals
    assert [c["fn"] for c in recorder.calls] == [
        "dequantize_4bit",
        "gemv_4bit",
        "dequantize_4bit",
        "quantize_4bit",
        "tc_gemm_4bit",
    ]
    assert recorder.calls[1]["args"][0] == kernel_calls.encode(x)
    assert recorder.calls[0]["kwargs"]["out_dtype"] == {"dtype": "float16"}


def test_written_log_loads_and_replays(tmp_path: Path) -> None:
    data, absmax, kw = _packed((4, 64))
    with kernel_calls.Recorder() as recorder:
        kernels.dequantize_4bit(data, absmax, out_dtype=torch.bfloat16, **kw)
        kernels.gemv_4bit(torch.randn(1, 64).to(DEVICE), data, absmax, **kw)
        kernels.tc_gemm_4bit(torch.randn(40, 64).to(DEVICE, torch.bfloat16), data, absmax, **kw)
    path = tmp_path / "calls.json"
    recorder.write(path)
    assert kernel_calls.load(path) == recorder.calls
    assert kernel_calls.replay(kernel_calls.load(path), DEVICE) | {"seconds": 0} == {
        "calls": 3,
        "failed": 0,
        "first_error": None,
        "seconds": 0,
    }


def test_a_failing_call_is_counted_and_the_replay_goes_on() -> None:
    data, absmax, kw = _packed((4, 64))
    good = kernel_calls.record("dequantize_4bit", (data, absmax), dict(kw, out_dtype=torch.float32))
    bad = kernel_calls.record("dequantize_4bit", (data, absmax), dict(kw, out_dtype=torch.int8))
    result = kernel_calls.replay([bad, good], DEVICE)
    assert (result["calls"], result["failed"]) == (2, 1)
    assert result["first_error"].startswith("dequantize_4bit: ValueError: kernels.dequantize_4bit: out_dtype")


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{", "cannot read the call log"),
        ('{"calls": 3}', "expected an object with a 'calls' list"),
        ('{"calls": [{"fn": "os.system", "args": [], "kwargs": {}}]}', "call 0 is not"),
        ('{"calls": [{"fn": "gemv_4bit", "args": {}, "kwargs": {}}]}', "call 0 is not"),
    ],
)
def test_a_broken_log_is_refused_with_its_file_named(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(kernel_calls.CallLogError, match=problem) as info:
        kernel_calls.load(path)
    assert str(path) in str(info.value)


def test_an_unknown_dtype_in_a_log_is_named() -> None:
    spec = {"tensor": {"shape": [2], "stride": [1], "dtype": "float99", "align": 0}}
    with pytest.raises(kernel_calls.CallLogError, match="unknown dtype 'float99'"):
        kernel_calls.decode(spec, DEVICE)


def test_the_packaged_log_loads_and_every_call_rebuilds() -> None:
    calls = kernel_calls.load(kernel_calls.DEFAULT_RUN_CALLS)
    assert {c["fn"] for c in calls} == set(kernel_calls.ENTRY_POINTS)
    for entry in calls:
        [kernel_calls.decode(a, torch.device("cpu")) for a in entry["args"]]
        {k: kernel_calls.decode(v, torch.device("cpu")) for k, v in entry["kwargs"].items()}


def test_command_line_replays_one_shard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data, absmax, kw = _packed((4, 64))
    recorder = kernel_calls.Recorder()
    recorder.calls = [
        kernel_calls.record("dequantize_4bit", (data, absmax), dict(kw, out_dtype=dtype))
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]
    recorder.write(tmp_path / "calls.json")
    device = ["--device", DEVICE.type]
    assert kernel_calls.main(["replay", str(tmp_path / "calls.json"), "--shard", "1", "--shards", "2", *device]) == 0
    assert json.loads(capsys.readouterr().out)["calls"] == 1  # shard 1 of 2 of three calls: the second
    assert kernel_calls.main(["replay", str(tmp_path / "missing.json"), *device]) == 2
    assert "cannot read the call log" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit):
        kernel_calls.main(["replay", str(tmp_path / "calls.json"), "--shard", "2", "--shards", "2"])
    assert "--shard must be in [0, 2)" in capsys.readouterr().err


def test_a_quantize_call_round_trips_through_the_log() -> None:
    """The quantize kernel's code boundaries are logged and rebuilt like a tensor argument,
    so the compile check can replay its calls."""
    from qconform_triton_nf4.compile.check import quantize_calls
    from qconform_triton_nf4.kernels import code_boundaries, quantize_4bit

    boundaries = code_boundaries(double_quant.code_table("fp4"))
    weight = torch.randn(3, 128, dtype=torch.bfloat16)
    entry = json.loads(
        json.dumps(kernel_calls.record("quantize_4bit", (weight,), {"blocksize": 64, "boundaries": boundaries}))
    )
    rebuilt = kernel_calls.decode(entry["kwargs"]["boundaries"], DEVICE)
    assert torch.equal(rebuilt.midpoints.cpu(), torch.zeros_like(boundaries.midpoints))  # values are not logged
    assert (rebuilt.zero_rank, rebuilt.negative_zero_code) == (boundaries.zero_rank, boundaries.negative_zero_code)
    assert rebuilt.rank_codes.dtype == torch.int32 and rebuilt.midpoints.shape == boundaries.midpoints.shape
    assert kernel_calls.replay([entry], DEVICE)["failed"] == 0
    packed, absmax = quantize_4bit(weight.to(DEVICE), blocksize=64, boundaries=boundaries.to(DEVICE))
    assert packed.numel() == 3 * 64 and absmax.numel() == 6
    assert {c["fn"] for c in quantize_calls()} == {"quantize_4bit"}

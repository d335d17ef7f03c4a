"""The recorded gemlite autotune choices: merged from workers, refused when unusable,
loaded only on the architecture they were tuned on. (Recording itself needs gemlite on a
GPU: ``nox -s gemlite-configs``.)"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from pytest_qconform.backends import gemlite_configs


def test_worker_parts_merge_into_one_sorted_file_and_go(tmp_path):
    parts = [tmp_path / "c.json.gw0.part", tmp_path / "c.json.gw1.part"]
    parts[0].write_text(json.dumps({"GEMV": {"(1, 128, 64, 64, 8, 0)": {"BLOCK_SIZE_N": 32}}, "GEMM": {}}))
    parts[1].write_text(json.dumps({"GEMV": {"(1, 64, 64, 32, 8, 0)": {"BLOCK_SIZE_N": 16}}}))
    gemlite_configs.merge(tmp_path / "c.json", parts)
    merged = json.loads((tmp_path / "c.json").read_text())
    assert merged == {
        "GEMV": {"(1, 128, 64, 64, 8, 0)": {"BLOCK_SIZE_N": 32}, "(1, 64, 64, 32, 8, 0)": {"BLOCK_SIZE_N": 16}}
    }
    assert not any(p.exists() for p in parts)


@pytest.mark.parametrize(
    ("text", "problem"), [("{", "cannot read"), ('{"GEMV": [1]}', "is not gemlite's config format")]
)
def test_an_unreadable_part_is_named(tmp_path, text, problem):
    part = tmp_path / "c.json.gw0.part"
    part.write_text(text)
    with pytest.raises(pytest.UsageError, match=problem) as info:
        gemlite_configs.merge(tmp_path / "c.json", [part])
    assert str(part) in str(info.value)


def test_nothing_is_loaded_off_the_recorded_architecture(monkeypatch):
    monkeypatch.setattr(gemlite_configs, "_loaded", None)
    monkeypatch.setitem(sys.modules, "gemlite", None)  # any attempt to load would fail to import it
    assert gemlite_configs.load_recorded(torch.device("cpu")) is False
    assert gemlite_configs.load_recorded(torch.device("cpu")) is False  # decided once per process


def test_the_recorded_file_is_in_gemlites_format():
    data = json.loads(gemlite_configs.RECORDED.read_text())
    assert data and all(kernel.isupper() and isinstance(configs, dict) and configs for kernel, configs in data.items())
    for configs in data.values():
        for key, config in configs.items():
            assert key.startswith("(") and {"num_warps", "num_stages"} <= set(config)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--qconform-record-gemlite-configs=missing/c.json"], "folder * does not exist"),
        (["--qconform-record-gemlite-configs=c.json"], "needs gemlite on a CUDA GPU*"),
    ],
)
def test_recording_where_it_cannot_run_is_a_usage_error(pytester: pytest.Pytester, args, problem):
    pytester.syspathinsert()
    pytester.makeconftest("import sys; sys.modules['gemlite'] = None  # gemlite cannot be imported here")
    result = pytester.runpytest_subprocess("--qconform", "--qconform-backend=hqq-gemlite", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--qconform-record-gemlite-configs*{problem}"])

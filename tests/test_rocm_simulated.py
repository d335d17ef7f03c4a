"""The ROCm paths, tested without an AMD GPU: torch's HIP attributes and device properties
are faked (tests/fake_rocm.py), so the probe's ROCm branch, the backends' ROCm failure
modes, the arch facts and ``qconform doctor`` run as on a ROCm runner. Nothing is computed
on a simulated device: these tests check gating, facts and reasons, never results."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# The faked device makes torch.cuda.is_available() true: the kernels this process imports must
# still be the interpreted ones the other test modules run, so the variable is set first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fake_rocm import DEVICES, HIP_VERSION, conftest, patch_torch

from pytest_qconform.__main__ import doctor
from pytest_qconform.hardware import archs
from pytest_qconform.hardware.probe import probe_hardware

bnb_cextension = pytest.importorskip("bitsandbytes.cextension")

# What bitsandbytes 0.50.2 raises (and then keeps, in its stand-in library) when the ROCm
# build of torch finds no library for its ROCm version (cextension.get_native_library).
BNB_NO_ROCM_BINARY = "No compatible ROCm binary found at /opt/venv/site-packages/bitsandbytes/libbitsandbytes_rocm64.so"
# A bitsandbytes built against ROCm 7.2 on torch's ROCm 6.3 runtime (shared/seeds/004).
BNB_UNDEFINED_SYMBOL = (
    "/opt/venv/site-packages/bitsandbytes/libbitsandbytes_rocm72.so: undefined symbol: "
    "hsa_amd_memory_get_preferred_copy_engine"
)


@pytest.fixture
def bnb_without_rocm_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes imported on ROCm, its library not loaded: what 0.50.2 leaves behind."""
    monkeypatch.setattr(bnb_cextension, "BNB_BACKEND", "ROCm")
    monkeypatch.setattr(bnb_cextension, "lib", bnb_cextension.ErrorHandlerMockBNBNativeLibrary(BNB_NO_ROCM_BINARY))


@pytest.mark.parametrize("arch", sorted(DEVICES))
def test_probe_reads_a_rocm_device(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    patch_torch(monkeypatch, arch)
    probe = probe_hardware()
    facts = archs.KNOWN_ARCHS[arch]
    gcn_arch_name, name, memory, _ = DEVICES[arch]
    assert (probe.device_kind, probe.arch, probe.family) == ("rocm", arch, facts.family), gcn_arch_name
    assert (probe.hip, probe.cuda, probe.device_name, probe.device_memory) == (HIP_VERSION, None, name, memory)
    assert (probe.bf16, probe.default_blocksize) == (facts.bf16, archs.ROCM_DEFAULT_BLOCKSIZE)
    assert probe.has_gpu and not probe.simulated


def test_an_arch_the_table_does_not_know_takes_torch_bf16_and_the_rocm_blocksize(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    patch_torch(monkeypatch, "gfx1200")
    props = torch.cuda.get_device_properties(0)
    monkeypatch.setattr(props, "gcnArchName", "gfx1151:xnack-")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    probe = probe_hardware()
    assert (probe.arch, probe.family, probe.bf16, probe.default_blocksize) == ("gfx1151", None, False, 128)


def test_bitsandbytes_without_its_rocm_library_is_unavailable_with_its_message(
    monkeypatch: pytest.MonkeyPatch, bnb_without_rocm_library: None
) -> None:
    from pytest_qconform.backends.bitsandbytes import BitsandbytesBackend

    patch_torch(monkeypatch, "gfx1200")
    available = BitsandbytesBackend().availability()
    assert not available.available and available.version
    assert available.reason == f"bitsandbytes: its ROCm library did not load: {BNB_NO_ROCM_BINARY}"


def test_bitsandbytes_on_the_cpu_needs_no_library(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_qconform.backends.bitsandbytes import BitsandbytesBackend

    monkeypatch.setattr(bnb_cextension, "BNB_BACKEND", "CPU")
    monkeypatch.setattr(bnb_cextension, "lib", bnb_cextension.ErrorHandlerMockBNBNativeLibrary("cpu"))
    assert BitsandbytesBackend().availability().available


def test_bitsandbytes_failing_to_import_on_rocm_is_unavailable_with_its_message(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pytest_qconform.backends.bitsandbytes import BitsandbytesBackend

    package = tmp_path / "bitsandbytes"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise OSError({BNB_UNDEFINED_SYMBOL!r})\n")
    for name in [n for n in sys.modules if n == "bitsandbytes" or n.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    patch_torch(monkeypatch, "gfx1200")
    available = BitsandbytesBackend().availability()
    assert not available.available
    assert available.reason == f"bitsandbytes: import failed: OSError: {BNB_UNDEFINED_SYMBOL}"


def test_triton_nf4_is_unavailable_where_triton_rejects_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """RDNA2: Triton 3.9 compiles nothing for gfx1030 (the compile check found it)."""
    pytest.importorskip("triton")
    from qconform_triton_nf4.backend import TritonNf4Backend

    patch_torch(monkeypatch, "gfx1030")
    rejected = TritonNf4Backend().availability()
    assert not rejected.available
    assert rejected.reason.startswith("triton 3.9.0 cannot compile for gfx1030: Triton's AMD backend rejects RDNA2")
    patch_torch(monkeypatch, "gfx1200")
    assert TritonNf4Backend().availability().available


@pytest.mark.parametrize(
    "arch, lines",
    [
        (
            "gfx1200",
            [
                "qconform probe: rocm gfx1200 (rdna4)",
                "  device: AMD Radeon RX 9060 XT (16.0 GiB)  host: *",
                f"  torch * cuda None  hip {HIP_VERSION}  triton *",
                "  bf16: yes  default 4-bit blocksize: 128  wave size: 32  cpu capability: *",
            ],
        ),
        (
            "gfx942",
            [
                "qconform probe: rocm gfx942 (cdna3)",
                "  device: AMD Instinct MI300X (192.0 GiB)  host: *",
                "  bf16: yes  default 4-bit blocksize: 128  wave size: 64  cpu capability: *",
            ],
        ),
        (
            "gfx1100",
            [
                "qconform probe: rocm gfx1100 (rdna3)",
                "  device: AMD Radeon RX 7900 XTX (24.0 GiB)  host: *",
                "  bf16: yes  default 4-bit blocksize: 128  wave size: 32  cpu capability: *",
            ],
        ),
    ],
)
def test_doctor_on_a_rocm_runner(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    bnb_without_rocm_library: None,
    arch: str,
    lines: list[str],
) -> None:
    patch_torch(monkeypatch, arch)
    assert doctor(None, as_json=False) == 0
    text = capsys.readouterr().out
    result = pytest.LineMatcher(text.splitlines())
    result.fnmatch_lines(
        lines
        + [f"  backend bitsandbytes: unavailable: bitsandbytes: its ROCm library did not load: {BNB_NO_ROCM_BINARY}"]
    )
    assert "SIMULATED" not in text, "a faked device is not --qconform-simulate: the probe takes the real branch"
    assert doctor(None, as_json=True) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["device_kind"], data["arch"], data["hip"], data["default_blocksize"]) == (
        "rocm",
        arch,
        HIP_VERSION,
        128,
    )
    assert data["backends"]["bitsandbytes"] == {
        "available": False,
        "version": data["backends"]["bitsandbytes"]["version"],
        "reason": f"bitsandbytes: its ROCm library did not load: {BNB_NO_ROCM_BINARY}",
    }


SUITE = textwrap.dedent("""
    import pytest
    import torch
    from pytest_qconform.suites._cases import require_claim

    @pytest.mark.qconform_operation("dequantize")
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
    def test_facts(qtarget, qbackend, dtype):
        require_claim(qbackend, qtarget, dtype=dtype)
        assert (qtarget.kind, qtarget.default_blocksize, qtarget.torch_device) == ("rocm", 128, "cuda:0")
""")


@pytest.mark.parametrize(
    "arch, marker, outcomes",
    [
        ("gfx1200", "gfx1200", {"passed": 2}),
        ("gfx942", "cdna3", {"passed": 2}),
        ("gfx1100", "rdna3", {"passed": 2}),
        ("gfx1030", "rocm", {"passed": 1}),  # RDNA2 has no bf16: the fact leaves bf16 unclaimed
    ],
)
def test_arch_facts_drive_the_checks_on_a_simulated_rocm_runner(
    pytester: pytest.Pytester, arch: str, marker: str, outcomes: dict[str, int]
) -> None:
    pytester.makeconftest(conftest(arch))
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        str(pytester.path),
        "--qconform",
        "--qconform-no-report",
        "--qconform-backend=fake",
        "-p",
        "no:cacheprovider",
        "-m",
        marker,
        "-rs",
    )
    result.assert_outcomes(**outcomes)
    result.stdout.fnmatch_lines(
        [f"qconform probe: rocm {arch} ({archs.KNOWN_ARCHS[arch].family})", "*default 4-bit blocksize: 128*"]
    )
    if arch == "gfx1030":
        result.stdout.fnmatch_lines(["*deselected: 1 not claimed by their backend (fake 1)*"])

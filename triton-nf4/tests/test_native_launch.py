"""The native launch under the adapter's plans (``kernels/native_launch``): its parameter
list is Triton's (constexprs left out, scratch pointers appended), it is refused where it
cannot be packed, the adapter falls back to Triton's launch where it is not had, and on a
GPU it returns, bit for bit, what the validated entry points return, for every route it
serves, and None for a call laid out otherwise."""

from __future__ import annotations

import copy
import os
import struct
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pytest_qconform.backends.base import QuantSpec  # noqa: E402  (after TRITON_INTERPRET)
from qconform_triton_nf4 import kernels  # noqa: E402
from qconform_triton_nf4.backend import TritonNf4Backend  # noqa: E402
from qconform_triton_nf4.kernels import native_launch  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fake_compiled(signature: dict[str, str], constants: dict | None = None, **metadata: int) -> SimpleNamespace:
    names = list(signature)
    src = SimpleNamespace(fn=SimpleNamespace(arg_names=names), signature=signature, constants=constants or {})
    meta = {"num_warps": 4, "shared": 0, "num_ctas": 1, **metadata}
    return SimpleNamespace(src=src, metadata=SimpleNamespace(**meta), function=1)


def test_parameter_slots_are_tritons_parameters_then_the_scratch_pointers() -> None:
    compiled = fake_compiled(
        {"x_ptr": "*bf16", "n": "i32", "one": "constexpr", "scale": "fp32", "big": "i64", "BLOCK": "constexpr"},
        constants={(2,): 1},
        global_scratch_size=0,
        profile_scratch_size=0,
    )
    slots = native_launch.parameter_slots(compiled, (None, 7, 1, 0.5, 2**40, 64))
    assert slots == [
        (0, "ptr", None),
        (1, "i32", 7),
        (3, "fp32", 0.5),
        (4, "i64", 2**40),
        (-1, "ptr", 0),
        (-1, "ptr", 0),
    ]
    assert native_launch._pack("i32", -2) == struct.pack("<i", -2) + bytes(4)
    assert native_launch._pack("fp32", 0.5) == struct.pack("<f", 0.5) + bytes(4)


@pytest.mark.parametrize(
    "signature, metadata",
    [
        ({"x_ptr": "*bf16", "flag": "i1"}, {}),  # a type it does not pack
        ({"x_ptr": "*bf16"}, {"global_scratch_size": 128}),  # scratch memory the launch would have to allocate
        ({"x_ptr": "*bf16"}, {"num_ctas": 2}),  # a cluster launch
        ({"x_ptr": "*bf16"}, {"launch_pdl": True}),
    ],
    ids=["bool-argument", "global-scratch", "cluster", "pdl"],
)
def test_parameter_slots_refuse_what_the_native_launch_cannot_pass(signature, metadata) -> None:
    compiled = fake_compiled(signature, **metadata)
    assert native_launch.parameter_slots(compiled, (None,) * len(signature)) is None


def test_without_the_native_launch_the_adapter_keeps_tritons_launch(monkeypatch) -> None:
    """Where the extension is not had (here forced off), no plan has a native launch and
    the calls return what the entry points return."""
    monkeypatch.setattr(native_launch, "module", lambda: None)
    backend = TritonNf4Backend()
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    q = backend.quantize(weight, QuantSpec("nf4", 64))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    first, again = backend.matmul(x, q, None, torch.bfloat16), backend.matmul(x, q, None, torch.bfloat16)
    expected = kernels.gemv_4bit(x, q.handle.packed, q.handle.absmax, **q.handle.kernel_args())
    assert q.handle.fast == [None] and set(q.handle.natives.values()) == {None}
    assert torch.equal(first, expected) and torch.equal(again, expected)


def test_the_switch_turns_the_native_launch_off(monkeypatch) -> None:
    monkeypatch.setenv(native_launch.ENV_SWITCH, "0")
    assert native_launch._unavailable_before_build() == f"{native_launch.ENV_SWITCH}=0"


def test_a_build_under_way_elsewhere_is_not_waited_for(monkeypatch, tmp_path) -> None:
    """While another process holds torch's build lock (the GPU warm-up building the
    extension), ``module()`` answers None at once and decides nothing, so the next plan asks
    again; ``wait=True`` (the warm-up itself) and a released lock load it."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(native_launch, "_LOADED", [])
    monkeypatch.setattr(native_launch, "_unavailable_before_build", lambda: None)
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    loads = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: loads.append(kwargs["name"]) or "built")
    (tmp_path / "lock").write_text("")
    assert native_launch.module() is None and native_launch._LOADED == [] and loads == []
    assert "another process is building it" in native_launch.unavailable_reason()
    (tmp_path / "lock").unlink()
    assert native_launch.module() == "built" and native_launch.module() == "built"
    assert loads == [native_launch.NAME]
    monkeypatch.setattr(native_launch, "_LOADED", [])
    (tmp_path / "lock").write_text("")
    assert native_launch.module(wait=True) == "built"


needs_native = pytest.mark.skipif(
    DEVICE.type != "cuda" or native_launch.module(wait=True) is None,
    reason=f"no native launch here: {native_launch.unavailable_reason()}",
)

# (weight shape, x shape, x dtype, bias, double quant): the rows kernel (one row), the
# tensor-core kernel without a K split (4 and 16 rows at 256 deep) and with one (2 and 4
# rows at 512 deep: the last program of a tile adds the splits), the word kernel (fp32 x),
# the elementwise kernel (K not a multiple of the blocksize), 3-D x.
ROUTES = [
    ((256, 512), (1, 512), torch.bfloat16, False, False),
    ((256, 512), (1, 512), torch.float16, True, True),
    ((192, 256), (4, 256), torch.bfloat16, True, False),
    ((192, 256), (16, 256), torch.float16, False, True),
    ((256, 512), (4, 512), torch.bfloat16, True, False),
    ((256, 512), (3, 512), torch.float32, True, False),
    ((64, 200), (2, 200), torch.bfloat16, True, False),
    ((256, 512), (2, 1, 512), torch.bfloat16, True, True),
]


@needs_native
@pytest.mark.parametrize("weight_shape, x_shape, dtype, with_bias, double_quant", ROUTES)
def test_native_launch_returns_the_entry_points_result(weight_shape, x_shape, dtype, with_bias, double_quant) -> None:
    backend = TritonNf4Backend()
    gen = torch.Generator().manual_seed(sum(x_shape))
    weight = torch.randn(*weight_shape, generator=gen).to(DEVICE)
    q = backend.quantize(weight, QuantSpec("nf4", 64, double_quant=double_quant))
    state = q.handle
    x = torch.randn(*x_shape, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(weight_shape[0], generator=gen).to(DEVICE, dtype) if with_bias else None
    expected = kernels.gemv_4bit(x, state.packed, state.absmax, bias=bias, **state.kernel_args())
    first = backend.matmul(x, q, bias, dtype)
    native = state.fast[0]
    assert native is not None, "every route listed has a native launch"
    later = [backend.matmul(x.clone(), q, bias, dtype) for _ in range(3)]  # through the native launch
    direct = native(x, bias)
    assert direct is not None and direct.shape == expected.shape and direct.dtype == dtype
    for y in (first, *later, direct):
        assert torch.equal(y, expected)


@needs_native
def test_native_launch_declines_other_layouts_and_recorded_calls() -> None:
    """None for another dtype, shape, stride, pointer alignment, bias or none, and for a
    call autograd records: the adapter then takes its keyed plans, which give the same
    result as the entry points."""
    backend = TritonNf4Backend()
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q = backend.quantize(weight, QuantSpec("nf4", 64))
    x = torch.randn(2, 264, device=DEVICE, dtype=torch.bfloat16)
    plain = x[:, :256].contiguous()
    backend.matmul(plain, q, None, torch.bfloat16)
    native = q.handle.fast[0]
    assert native is not None
    others = {
        "dtype": (plain.half(), None),
        "shape": (plain[:1], None),
        "stride": (x[:, :256], None),
        "alignment": (x.reshape(-1)[4 : 4 + 512].view(2, 256), None),
        "bias": (plain, torch.zeros(128, device=DEVICE, dtype=torch.bfloat16)),
        "recorded": (plain.clone().requires_grad_(), None),
    }
    for name, (x_other, bias) in others.items():
        assert native(x_other, bias) is None, name
    for name, (x_other, bias) in others.items():
        y = backend.matmul(x_other, q, bias, x_other.dtype)
        args = copy.copy(q.handle.kernel_args())
        expected = kernels.gemv_4bit(x_other.detach(), q.handle.packed, q.handle.absmax, bias=bias, **args)
        assert torch.equal(y.detach(), expected), name

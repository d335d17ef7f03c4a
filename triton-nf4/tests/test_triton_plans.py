"""The Triton adapter's planned calls (``triton_nf4/plans``) and the bound kernel launch
under them (``kernels/launch``): a planned call returns what the validated entry points
return, plans follow the activation's layout, a copied weight starts with none, and a
bound launch passes Triton's runner (or its launcher) every argument in signature order."""

from __future__ import annotations

import copy
import inspect
import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pytest_qconform.backends.base import QuantSpec  # noqa: E402  (after TRITON_INTERPRET)
from qconform_triton_nf4.backend import TritonNf4Backend  # noqa: E402
from qconform_triton_nf4.kernels.launch import BoundLaunch, constexpr_tail  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class FakeKernel:
    """A JIT kernel as ``BoundLaunch`` sees it: signature, constexpr positions, ``[grid]``
    returning ``compiled`` (whose ``[grid]`` records the runner's calls)."""

    def __init__(self, compiled: object | None) -> None:
        def kernel(x_ptr, n, BLOCK, FLAG=True):  # noqa: N803 - Triton's constexpr naming
            pass

        self.signature = inspect.signature(kernel)
        self.constexprs = [2, 3]
        self.compiled = compiled
        self.launches: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled

        return launch


class FakeCompiled:
    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args: self.runs.append((grid, args))


def test_bound_launch_runs_the_compiled_kernel_with_constexprs_after_the_first_call() -> None:
    compiled = FakeCompiled()
    kernel = FakeKernel(compiled)
    launch = BoundLaunch(kernel, (5,), {"BLOCK": 64, "num_warps": 4})
    launch("x", 10)
    assert kernel.launches == [((5,), ("x", 10), {"BLOCK": 64, "num_warps": 4})] and launch.bound
    launch("y", 10)
    assert compiled.runs == [((5, 1, 1), ("y", 10, 64, True))]  # FLAG from its default; num_warps is no parameter
    assert len(kernel.launches) == 1


def test_bound_launch_keeps_the_ordinary_launch_without_a_compiled_kernel() -> None:
    kernel = FakeKernel(None)  # Triton's interpreter returns nothing
    launch = BoundLaunch(kernel, (2,), {"BLOCK": 64})
    launch("x", 1)
    launch("y", 1)
    assert [args for _, args, _ in kernel.launches] == [("x", 1), ("y", 1)] and not launch.bound


def test_constexpr_tail_refuses_kernels_it_cannot_order() -> None:
    kernel = FakeKernel(None)
    assert constexpr_tail(kernel, 2, {"BLOCK": 8}) == (8, True)
    assert constexpr_tail(kernel, 1, {"BLOCK": 8}) is None  # a runtime parameter would be left out
    assert constexpr_tail(kernel, 2, {}) is None  # BLOCK has no value
    assert constexpr_tail(object(), 2, {}) is None


@pytest.fixture(scope="module")
def quantized():
    backend = TritonNf4Backend()
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    return backend, backend.quantize(weight, QuantSpec("nf4", 64, double_quant=True))


@pytest.mark.parametrize("rows", [1, 4, 17], ids=lambda rows: f"M{rows}")
def test_planned_matmul_equals_the_validated_entry_points(quantized, rows: int) -> None:
    """The plan is the only route: its first and later calls return what the entry points
    return (``gemv_4bit`` for the fused rows, ``dequantize_4bit`` + ``torch.matmul`` past them;
    on sm_90 ``ws_gemm_4bit`` from its first rows)."""
    from qconform_triton_nf4 import kernels
    from qconform_triton_nf4.backend import FUSED_MAX_ROWS

    backend, q = quantized
    q = copy.deepcopy(q)
    state = q.handle
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
    bias = torch.randn(64).to(DEVICE, torch.bfloat16)
    first = backend.matmul(x, q, bias, torch.bfloat16)  # builds the plan through the validated checks
    assert len(state.plans) >= 1
    again = backend.matmul(x.clone(), q, bias, torch.bfloat16)  # the plan, kept
    low, high = kernels.ws_min_rows(x.device), kernels.ws_max_rows(x.device, 64 * 256)
    if low and low <= rows <= high and kernels.ws_gemm_readable(x, state.packed, 256, state.blocksize):
        expected = kernels.ws_gemm_4bit(x, state.packed, state.absmax, bias=bias, **state.kernel_args())
    elif rows <= min(FUSED_MAX_ROWS, kernels.fused_rows_limit(x, state.packed, 256)):
        expected = kernels.gemv_4bit(x, state.packed, state.absmax, bias=bias, **state.kernel_args())
    else:
        weight = kernels.dequantize_4bit(state.packed, state.absmax, out_dtype=torch.bfloat16, **state.kernel_args())
        expected = torch.matmul(x, weight.t()) + bias
    assert torch.equal(first, expected) and torch.equal(again, expected)


def test_plans_validate_on_the_first_call_of_a_key(quantized) -> None:
    backend, q = quantized
    q = copy.deepcopy(q)
    with pytest.raises((ValueError, RuntimeError)):
        backend.matmul(torch.zeros(1, 255, device=DEVICE, dtype=torch.bfloat16), q, None, torch.bfloat16)
    assert q.handle.plans == {}


def test_direct_launcher_calls_the_launcher_and_yields_to_launch_hooks(monkeypatch) -> None:
    """Below the runner: the launcher gets the stream, the function, the metadata and no
    hooks; a launch hook set later sends the call through Triton's runner."""
    from triton import knobs

    from qconform_triton_nf4.kernels import launch as launch_module

    class CudaLauncher:  # the name direct_launcher checks
        global_scratch_size = profile_scratch_size = 0

        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def __call__(self, *args):
            self.calls.append(args)

    class Compiled:
        function, packed_metadata = 7, (4, 1, 0)

        def __init__(self) -> None:
            self.run = CudaLauncher()

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    monkeypatch.setattr(launch_module, "C_LAUNCH_VERSIONS", ("no such version",))
    compiled, runner_calls = Compiled(), []
    launch = launch_module.direct_launcher(compiled, (2, 1, 1), (64,), lambda *args: runner_calls.append(args))
    assert launch is not None
    launch("x", 3)
    assert compiled.run.calls == [(2, 1, 1, 99, 7, (4, 1, 0), None, None, None, "x", 3, 64)] and not runner_calls
    hook = knobs.runtime.launch_enter_hook

    def watching(metadata):
        return None

    if hasattr(hook, "add"):
        hook.add(watching)
        try:
            launch("y", 3)
        finally:
            hook.remove(watching)
        assert runner_calls == [("y", 3, 64)] and len(compiled.run.calls) == 1


def test_descriptor_launch_encodes_a_descriptor_passed_again_once(monkeypatch) -> None:
    """Triton 3.6's C launch under its descriptor-encoding wrapper: each leading
    descriptor encoded by Triton's ``make_tensordesc_arg``, the one passed again (the
    weight's) not again, a new one (x's, every call) afresh; a launch hook set later sends
    the call, descriptors as they came, through Triton's runner."""
    import triton
    import triton.backends.nvidia.driver as nvidia_driver
    from triton import knobs

    from qconform_triton_nf4.kernels import launch as launch_module

    raw_calls: list[tuple] = []

    def launcher(*args):  # the generated C launch, as the wrapper closes over it
        raw_calls.append(args)

    def inner(*args):  # Triton 3.6's wrap_handle_tensordesc
        return launcher(*args)

    class Descriptor:
        def __init__(self, name: str) -> None:
            self.name = name

    class CudaLauncher:
        launch_cooperative_grid, launch_pdl = False, False
        global_scratch_size = profile_scratch_size = 0
        launch = staticmethod(inner)

    class Compiled:
        function, packed_metadata = 7, (4, 1, 0)
        src = types.SimpleNamespace(
            signature={"x": "tensordesc<bf16[64, 64]>", "w": "tensordesc<i32[64, 8]>", "a": "*fp32"}
        )
        metadata = types.SimpleNamespace(tensordesc_meta=[{"swizzle": 128}, {"swizzle": 0}])
        run = CudaLauncher()

    encodings: list[str] = []

    def encode(descriptor, meta):
        encodings.append(descriptor.name)
        return [f"map-{descriptor.name}-{meta['swizzle']}", 64, 1]

    monkeypatch.setattr(nvidia_driver, "make_tensordesc_arg", encode)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 99, raising=False)
    monkeypatch.setattr(launch_module, "C_LAUNCH_VERSIONS", (triton.__version__,))
    runner_calls: list[tuple] = []
    launch = launch_module.direct_launcher(Compiled(), (2, 1, 1), (16,), lambda *args: runner_calls.append(args))
    assert launch is not None
    weight = Descriptor("w")
    launch(Descriptor("x0"), weight, 5)
    launch(Descriptor("x1"), weight, 5)
    assert encodings == ["x0", "w", "x1"]
    head = (2, 1, 1, 99, 7, False, False, None, None, (4, 1, 0), None, None, None)
    assert raw_calls[1] == (*head, "map-x1-128", 64, 1, "map-w-0", 64, 1, 5, 16) and not runner_calls
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        watching = lambda metadata: None  # noqa: E731
        x2 = Descriptor("x2")
        hook.add(watching)
        try:
            launch(x2, weight, 5)
        finally:
            hook.remove(watching)
        assert runner_calls == [(x2, weight, 5, 16)] and len(raw_calls) == 2


def test_descriptors_not_leading_take_no_direct_launch() -> None:
    from qconform_triton_nf4.kernels import launch as launch_module

    def compiled(signature, metas):
        return types.SimpleNamespace(
            src=types.SimpleNamespace(signature=signature), metadata=types.SimpleNamespace(tensordesc_meta=metas)
        )

    leading = launch_module.leading_descriptors
    assert leading(compiled({"a": "*fp32", "n": "i32"}, None)) == []
    assert leading(compiled({"x": "tensordesc<bf16[64, 64]>", "a": "*fp32"}, [{"swizzle": 128}])) == [{"swizzle": 128}]
    assert leading(compiled({"a": "*fp32", "x": "tensordesc<bf16[64, 64]>"}, [{"swizzle": 128}])) is None
    assert leading(compiled({"x": "tensordesc<bf16[64, 64]>"}, None)) is None  # lowered without a CUtensorMap


def test_plans_follow_the_layout_and_copies_start_without_them(quantized) -> None:
    backend, q = quantized
    q = copy.deepcopy(q)
    assert q.handle.plans == {}
    x = torch.randn(2, 257).to(DEVICE, torch.bfloat16)
    backend.matmul(x[:, :256], q, None, torch.bfloat16)
    backend.matmul(x[:, 1:], q, None, torch.bfloat16)  # another pointer alignment: another plan
    backend.dequantize(q, torch.bfloat16)
    assert len(q.handle.plans) == 3
    twin = copy.deepcopy(q)
    assert twin.handle.plans == {} and twin.handle.packed.data_ptr() != q.handle.packed.data_ptr()
    assert torch.equal(backend.dequantize(twin, torch.bfloat16), backend.dequantize(q, torch.bfloat16))


def test_x_8_bytes_off_16_takes_its_own_plan_with_the_same_bits(quantized) -> None:
    """The tensor-core kernel reads x in 16-byte loads where x is 16-byte aligned, else in
    8-byte loads; on a GPU a 16-byte load 8 bytes off is a misaligned-address fault. x of
    the same shape and strides 8 bytes off takes its own plan, in either order, and both
    loads give the same bits."""
    backend, original = quantized
    storage = torch.randn(4 * 256 + 4, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    aligned, off = storage[: 4 * 256].view(4, 256), storage[4:].view(4, 256)
    assert aligned.data_ptr() % 16 == 0 and off.data_ptr() % 16 == 8
    for order in ((aligned, off), (off, aligned)):
        q = copy.deepcopy(original)
        first = [backend.matmul(x, q, None, torch.bfloat16) for x in order]
        assert len(q.handle.plans) == 2
        shifted = backend.matmul(off, q, None, torch.bfloat16)
        assert torch.equal(shifted, backend.matmul(off.clone(), q, None, torch.bfloat16))  # 8- and 16-byte loads
        assert all(torch.equal(y, backend.matmul(x, q, None, torch.bfloat16)) for x, y in zip(order, first))


def test_gradient_still_flows_through_the_autograd_function(quantized) -> None:
    backend, q = quantized
    x = torch.randn(3, 256).to(DEVICE, torch.float32).requires_grad_()
    backend.matmul(x, q, None, torch.float32).sum().backward()
    expected = backend.dequantize(q, torch.float32).sum(0).expand(3, -1)
    assert x.grad is not None and torch.allclose(x.grad, expected, rtol=1e-5, atol=1e-4)

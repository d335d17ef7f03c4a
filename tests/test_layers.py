"""The layer facet: FunctionalLinear's two rules, the requantization reference, and the
layer suites' skips (no facet: not claimed; no optional dependency: skipped, naming it)."""

import json
import textwrap

import pytest
import torch
from fake_backend import FAKE_BACKEND
from pytest_qconform.reference import bnb4, hqq4, requantize
from pytest_qconform.reference.packed import PackedHqq4
from qconform_example_nf4.backend import TorchNF4Backend

from conftest import EXAMPLE_SRC
from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.functional_layer import FunctionalLayers

SPEC = QuantSpec("nf4", 64)


def _layer(spec: QuantSpec = SPEC, seed: int = 0):
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(seed))
    return FunctionalLayers(TorchNF4Backend()).quantize(
        weight, torch.randn(16), spec, torch.bfloat16, torch.device("cpu")
    )


def test_dtype_casts_leave_the_quantization_state_alone() -> None:
    layer = _layer()
    before = {k: v.clone() for k, v in layer.state().items()}
    layer.half()
    assert layer.bias.dtype == torch.float16
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in layer.state().items())


def test_load_takes_the_checkpoints_blocksize_and_sizes() -> None:
    saved, loading = _layer(QuantSpec("nf4", 64), 1), _layer(QuantSpec("nf4", 128), 2)
    loading.load_state_dict(saved.state_dict())
    assert int(loading.quant_blocksize) == 64
    assert torch.equal(loading.quant_absmax, saved.quant_absmax)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(loading(x), saved(x))


def test_a_state_the_backend_refuses_is_an_error_not_a_mix() -> None:
    saved, loading = _layer(seed=1), _layer(seed=2)
    state = {k: v for k, v in saved.state_dict().items() if k != "quant_blocksize"}
    with pytest.raises(RuntimeError, match="refused the checkpoint's quantization state"):
        loading.load_state_dict(state, strict=False)


def test_a_buffer_replaced_from_outside_is_what_the_layer_computes_with() -> None:
    """accelerate's set_module_tensor_to_device (a move, or a load as transformers loads)
    assigns ``module._buffers[name]`` directly, bypassing ``_apply``: the layer must then
    compute with the new buffer, not the one it was built from."""
    set_module_tensor_to_device = pytest.importorskip("accelerate.utils").set_module_tensor_to_device
    saved, loading = _layer(seed=1), _layer(seed=2)
    for name, value in saved.state_dict().items():
        set_module_tensor_to_device(loading, name, "cpu", value=value)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(loading(x), saved(x))


def test_a_layer_moved_to_meta_and_loaded_computes_with_what_was_loaded() -> None:
    """accelerate's FSDP2 ``cpu_ram_efficient_loading`` moves a model to the meta device and
    loads rank 0's state dict into it (``assign=True``): the move must not read the state's
    values (there are none), the layer must refuse to compute until it holds real ones, and
    then compute with those it was given."""
    saved, loading = _layer(seed=1), _layer(seed=2)
    loading.to(torch.device("meta"))
    assert "format=meta" in repr(loading)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="on the meta device"):
        loading(x)
    loading.load_state_dict(saved.state_dict(), assign=True)
    assert torch.equal(loading(x), saved(x))


def test_requantize_bound_holds_for_nearest_rounding_and_catches_stale_scales() -> None:
    target = torch.randn(8, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    fresh = bnb4.encode(target.float(), "nf4", 64)
    zero = torch.zeros_like(target)
    decoded = bnb4.decode(fresh)
    assert bool(((decoded - target).abs() <= requantize.requantize_bound(fresh, target, zero)).all())
    # The merged codes decoded with the old weight's scales (absmax of another tensor):
    stale = bnb4.encode((target * 0.5).float(), "nf4", 64)
    mixed = type(fresh)(**{**vars(fresh), "absmax": stale.absmax})
    assert not bool(((bnb4.decode(mixed) - target).abs() <= requantize.requantize_bound(mixed, target, zero)).all())


def test_requantize_grid_of_hqq_is_q_minus_zero_times_scale() -> None:
    packed = PackedHqq4(
        shape=(2, 64),
        group_size=64,
        axis=1,
        packed=(torch.arange(64, dtype=torch.uint8) % 16).reshape(1, 64).numpy().repeat(1, 0),
        scale=torch.tensor([0.5, 0.25]).numpy(),
        zero=torch.tensor([7.5, 8.0]).numpy(),
        packing="4bit_u8",
        meta={},
    )
    grid = requantize.grid_values(packed)
    assert grid.shape == (2, 64, 16)
    assert torch.equal(grid[0, 0], (torch.arange(16, dtype=torch.float64) - 7.5) * 0.5)
    assert bool((requantize.nearest_distance(packed, hqq4.decode(packed)) == 0).all())


LAYER_SUITE_ARGS = ("--qconform", "-p", "no:cacheprovider", "-q", "--tb=short")


def test_a_backend_without_the_layer_facet_gets_no_layer_cells(pytester: pytest.Pytester) -> None:
    hook = "\ndef pytest_qconform_backends(config):\n    return {'fake': FakeBackend}\n"
    pytester.makepyfile(fakelayers=FAKE_BACKEND + hook)
    pytester.syspathinsert()
    from pytest_qconform.session.plugin import suites_dir

    suites = suites_dir()
    result = pytester.runpytest(
        "-p",
        "fakelayers",
        str(suites / "test_layers.py"),
        str(suites / "test_checkpoint.py"),
        *LAYER_SUITE_ARGS,
        "--qconform-backend=fake",
        f"--qconform-report-dir={pytester.path}",
        "-rs",
    )
    result.stdout.fnmatch_lines(["*not claimed: fake offers no layer (Backend.layers() is None)*"])
    report = json.loads(next(pytester.path.glob("*.json")).read_text())
    # Only the one cell of a check whose axes it claims no value of (bf16/fp16 models).
    assert {c["verdict"] for c in report["cells"] if c["backend"] == "fake"} <= {"not-claimed"}


def test_layer_suites_without_the_layers_extra_skip_naming_it(pytester: pytest.Pytester) -> None:
    """transformers, PEFT and safetensors hidden: their cases skip, saying what to install."""
    pytester.makepyfile(
        hiddenextra=textwrap.dedent(f"""
        import sys
        for name in ("transformers", "peft", "safetensors", "safetensors.torch"):
            sys.modules[name] = None
        sys.path.insert(0, {str(EXAMPLE_SRC)!r})
        from qconform_example_nf4.backend import TorchNF4Backend

        def pytest_qconform_backends(config):
            return {{"torch-nf4": TorchNF4Backend}}
    """)
    )
    pytester.syspathinsert()
    from pytest_qconform.session.plugin import suites_dir

    result = pytester.runpytest_subprocess(
        "-p",
        "hiddenextra",
        str(suites_dir() / "test_checkpoint.py"),
        *LAYER_SUITE_ARGS,
        "-rs",
        "--qconform-backend=torch-nf4",
        "--qconform-no-report",
        "-k",
        "fresh_layer",
    )
    # "?" for the brackets, which fnmatch reads as a character class
    result.stdout.fnmatch_lines(["*needs safetensors, which is not installed: pip install 'pytest-qconform?layers?'*"])
    # every case skipped: nothing was checked, and the run says so (exit 5), not green
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout.str()[-2000:]


def test_requantize_bound_places_a_double_quantized_grid_from_the_target() -> None:
    """A double-quantized absmax is not stored in fp32: the bound takes the quantizer's block
    maxima from the target, within the target's error (``quantizer_block_maxima``). bitsandbytes'
    own double-quantized requantization of a target (known to within a bf16 rounding) passes;
    the same codes decoded with another tensor's nested absmax and offset fail."""
    pytest.importorskip("bitsandbytes")
    from pytest_qconform.reference import bounds

    from pytest_qconform.backends import registry

    backend = registry.create("bitsandbytes")
    target = torch.randn(8, 128, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    error = bounds.rounding_bound(target, torch.bfloat16)
    spec = QuantSpec("nf4", 64, True)
    fresh = backend.export_packed(backend.quantize(target.to(torch.bfloat16), spec))
    assert fresh.double_quant
    assert bool(((bnb4.decode(fresh) - target).abs() <= requantize.requantize_bound(fresh, target, error)).all())
    stale = backend.export_packed(backend.quantize((target * 0.5).to(torch.bfloat16), spec))
    mixed = type(fresh)(**{**vars(fresh), "nested_absmax": stale.nested_absmax, "offset": stale.offset})
    bound = requantize.requantize_bound(mixed, target, error)
    assert not bool(((bnb4.decode(mixed) - target).abs() <= bound).all())

"""``pytest_qconform.watch``: the call-site oracle judges a model's calls, names the failing
one with its context, refuses a watch that judged nothing, and names a backend it cannot watch."""

from __future__ import annotations

import pytest
import torch
from qconform_example_nf4.backend import TorchNF4Backend
from zoo import _CompiledDropsBiasLinear, _InferenceModeDropsBiasLinear, layers_building

from pytest_qconform.backends.functional_layer import FunctionalLinear
from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.watch import WatchFailure, layer_facets, watch


def _model(layer_class=None) -> tuple[torch.nn.Module, dict]:
    backend = TorchNF4Backend()
    facet = layers_building(backend, layer_class or FunctionalLinear)
    gen = torch.Generator().manual_seed(5)
    layers = [
        facet.quantize(
            torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen),
            QuantSpec("nf4", 64),
            torch.float32,
            torch.device("cpu"),
        )
        for n, k in ((128, 64), (64, 128))
    ]
    return torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1]), {backend.name: facet}


def test_every_sampled_call_is_judged_with_its_context() -> None:
    model, facets = _model()
    x = torch.randn(2, 3, 64, requires_grad=True)
    with watch(model, facets) as oracle:
        model(x).sum().backward()
        with torch.inference_mode():
            model(torch.randn(5, 64))
    assert oracle.verdicts and not oracle.failures
    contexts = oracle.summary()["torch-nf4"]["contexts"]
    assert "forward grad cpu 3-D contiguous fp32" in contexts
    assert "forward no-grad inference-mode cpu 2-D contiguous fp32" in contexts
    assert any(signature.startswith("backward") for signature in contexts)


def test_a_call_outside_its_bound_fails_naming_layer_call_and_context() -> None:
    model, facets = _model(_InferenceModeDropsBiasLinear)
    with pytest.raises(WatchFailure, match=r"0 \[torch-nf4\] forward call 1 \(4 rows; forward no-grad inference-mode"):
        with watch(model, facets), torch.inference_mode():
            model(torch.randn(4, 64))


def test_a_compiled_call_is_judged_as_compiled() -> None:
    """Inside the compiled model the hook only queues the call, without breaking dynamo's
    graph; the queue is judged as compiled calls when the next eager call comes, and the
    same model's eager calls are not compiled ones (``backend="eager"``: dynamo's tracing
    without inductor's code generation)."""
    model, facets = _model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    try:
        with watch(model, facets) as oracle, torch.no_grad():
            compiled(torch.randn(3, 64))
            model(torch.randn(3, 64))
    finally:
        torch._dynamo.reset()
    assert not torch._dynamo.utils.counters["graph_break"], torch._dynamo.utils.counters["graph_break"]
    contexts = oracle.summary()["torch-nf4"]["contexts"]
    assert contexts == {
        "forward no-grad compiled cpu 2-D contiguous fp32": 2,
        "forward no-grad cpu 2-D contiguous fp32": 2,
    }


def test_a_bug_only_in_the_compiled_path_fails_as_a_compiled_call() -> None:
    """The compiled queue can fail: a layer wrong only while dynamo traces it (its bias
    dropped) passes every eager call and fails the compiled one, named as compiled."""
    model, facets = _model(_CompiledDropsBiasLinear)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    try:
        with pytest.raises(
            WatchFailure,
            match=r"2 of 4 judged calls failed:\n  0 \[torch-nf4\] forward call 2 \(3 rows; forward no-grad compiled cpu",
        ):
            with watch(model, facets), torch.no_grad():
                model(torch.randn(3, 64))  # eager: right
                compiled(torch.randn(3, 64))
    finally:
        torch._dynamo.reset()


def test_a_captured_call_is_judged_when_the_watch_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call made while a CUDA graph is captured has no values yet: it waits for
    ``settle()`` (which the watch calls as it ends) and is judged on the tensors' values
    then. Capture is simulated (no GPU here): the layer's output is overwritten after the
    call, as a replay would write it, and the oracle must judge the overwritten values."""
    from pytest_qconform.watch import context
    from pytest_qconform.watch import oracle as oracle_module

    model, facets = _model()
    monkeypatch.setattr(context, "capturing", lambda device: True)
    monkeypatch.setattr(oracle_module.torch.cuda, "synchronize", lambda *a: None)
    x = torch.randn(4, 64)
    with pytest.raises(WatchFailure, match=r"forward no-grad captured cpu"):
        with watch(model, facets) as oracle, torch.no_grad():
            y = model[0](x)
            assert not oracle.verdicts  # pending: nothing computed yet under a real capture
            y.add_(1.0)  # what a replay with other values leaves in the captured output
    assert len(oracle.verdicts) == 1 and oracle.verdicts[0].context.captured


def test_a_watch_that_judged_nothing_fails() -> None:
    model, facets = _model()
    with pytest.raises(WatchFailure, match="judged no call: 2 quantized layers"):
        with watch(model, facets):
            pass


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(Exception, match="unknown backend 'no-such-backend'"):
        layer_facets(["no-such-backend"])


QWATCH_TEST = """
import pytest
import torch
from pytest_qconform.backends.spec import QuantSpec


@pytest.mark.qconform_operation("workload:my-model")
@pytest.mark.qconform_dtype("fp32")
def test_my_model_under_the_oracle(qtarget, qbackend, qdevice, qwatch):
    facet = qbackend.layers()
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 64, generator=gen)
    model = torch.nn.Sequential(facet.quantize(weight, None, QuantSpec("nf4", 64), torch.float32, qdevice))
    with qwatch(model):
        model(torch.randn(2, 5, 64, device=qdevice))
"""


def test_the_qwatch_fixture_writes_the_judged_calls_into_the_report(pytester: pytest.Pytester) -> None:
    """A downstream test's own model under ``qwatch``: its cell passes, and the report's
    ``calls`` section names the operation, the calls judged and their context."""
    import json
    import textwrap

    from conftest import EXAMPLE_SRC

    pytester.makeconftest(
        textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(EXAMPLE_SRC)!r})
        from qconform_example_nf4.backend import TorchNF4Backend

        def pytest_qconform_backends(config):
            return {{"torch-nf4": TorchNF4Backend}}
        """)
    )
    pytester.makepyfile(test_mine=QWATCH_TEST)
    result = pytester.runpytest(
        "test_mine.py", "--qconform", "--qconform-backend=torch-nf4", f"--qconform-report-dir={pytester.path}"
    )
    result.assert_outcomes(passed=1)
    report = json.loads(next(pytester.path.glob("*.json")).read_text())
    (calls,) = report["calls"]
    assert (calls["backend"], calls["operation"], calls["failed"]) == ("torch-nf4", "workload:my-model", 0)
    assert calls["judged"] == calls["seen"] == 1
    assert calls["contexts"] == {"forward grad cpu 3-D contiguous fp32": 1}
    (cell,) = [c for c in report["cells"] if c["operation"] == "workload:my-model"]
    assert cell["verdict"] == "pass" and cell["worst_error_multiple"] is not None

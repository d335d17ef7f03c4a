"""The call-site oracle's comparative check (``reference.comparative``) and its way into the
report: a layer whose running sum is kept in bf16 passes every call's worst-case bound and
fails the comparison with torch's own dense op, with its own message; a correct layer's
calls carry their ratios; a test's worst ratio becomes its cell's ``worst_comparative_ratio``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pytest_qconform.reference.comparative import COMPARATIVE_FACTOR
from qconform_example_nf4.backend import TorchNF4Backend
from zoo import layers_building

from pytest_qconform.backends.functional_layer import FunctionalLinear
from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.report.cells import COMPARATIVE_PROPERTY, Cell, fold_cell
from pytest_qconform.session import outcomes, recorder
from pytest_qconform.vocabulary import Verdict
from pytest_qconform.watch import WatchFailure, watch

K = 1024  # long rows: a bf16 running sum is ~7 times torch's error here (tests/test_reference_comparative.py)


class _Bf16RunningSumLinear(FunctionalLinear):
    """Exact fp32 sums of 4 products, added one by one into a bf16 running sum."""

    def forward(self, x):
        w = self.backend.dequantize(self.quantized, self.compute_dtype)
        tiles = (x.to(self.compute_dtype).float().unsqueeze(-2) * w.float()).reshape(*x.shape[:-1], w.shape[0], -1, 4)
        sums = tiles.sum(-1)
        y = torch.zeros(sums.shape[:-1], dtype=self.compute_dtype)
        for j in range(sums.shape[-1]):
            y = y + sums[..., j].to(self.compute_dtype)
        return (y + self.bias.to(self.compute_dtype) if self.bias is not None else y).to(x.dtype)


def _model(layer_class=None) -> tuple[torch.nn.Module, dict]:
    backend = TorchNF4Backend()
    facet = layers_building(backend, layer_class or FunctionalLinear)
    gen = torch.Generator().manual_seed(7)
    layer = facet.quantize(
        torch.randn(64, K, generator=gen), None, QuantSpec("nf4", 64), torch.bfloat16, torch.device("cpu")
    )
    return torch.nn.Sequential(layer), {backend.name: facet}


def test_a_bf16_running_sum_passes_the_bound_and_fails_the_comparison() -> None:
    model, facets = _model(_Bf16RunningSumLinear)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    with pytest.raises(WatchFailure) as failed, torch.no_grad():
        with watch(model, facets):
            model(x)
    message = str(failed.value)
    assert "within its worst-case bound" in message
    assert "x torch's own F.linear error at the 90th percentile" in message


def test_a_correct_layer_records_its_ratio_forward_and_backward() -> None:
    model, facets = _model()
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).requires_grad_(True)
    with watch(model, facets) as oracle:
        model(x).float().sum().backward()
    assert not oracle.failures
    directions = {v.context.direction: v.comparative for v in oracle.verdicts}
    assert set(directions) == {"forward", "backward"}, directions
    assert all(ratio is not None and ratio <= COMPARATIVE_FACTOR for ratio in directions.values()), directions
    assert oracle.worst_comparative == max(directions.values())


def _cell(ratio: float | None) -> Cell:
    return Cell("b", "matmul", "nf4-b64", "bf16", Verdict.PASS, worst_comparative_ratio=ratio)


def test_a_tests_worst_ratio_goes_into_its_cell_and_the_cells_fold_to_the_worst() -> None:
    case = outcomes.Case("t::a", "x86_64", _cell(None))
    report = SimpleNamespace(user_properties=[(COMPARATIVE_PROPERTY, 1.5), (COMPARATIVE_PROPERTY, 2.5)])
    recorded = recorder._with_comparative(case, report)
    assert recorded is not None and recorded.cell.worst_comparative_ratio == 2.5
    assert recorder._with_comparative(case, SimpleNamespace(user_properties=[])) is case
    assert fold_cell([_cell(None), _cell(0.8), _cell(2.5)]).worst_comparative_ratio == 2.5
    assert fold_cell([_cell(None), _cell(None)]).worst_comparative_ratio is None

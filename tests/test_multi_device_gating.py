"""A single-device run never claims the multi-device cells, and the distributed ones are
opt-in (issue 37): on a machine with fewer than two GPUs the ``multi_gpu`` checks are
deselected and counted in the summary line, ``-m multi_gpu`` shows them skipped with the
reason, and the ``distributed`` checks run only when ``-m`` names them."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has two GPUs: the cells run")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        "--qconform", "--qconform-no-report", "--qconform-backend=hqq", "-p", "no:randomly", *args
    )


def test_multi_gpu_checks_are_deselected_and_distributed_ones_opt_in(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-k", "test_quantize_on_another_device or test_ddp_qlora_step")
    result.stdout.fnmatch_lines(
        [
            "*multi_gpu (this machine has fewer than two GPUs; -m multi_gpu shows them skipped)*"
            "opt-in (-m distributed runs its*"
        ]
    )
    result.assert_outcomes()


def test_multi_gpu_checks_asked_for_are_skipped_with_the_reason(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-m", "multi_gpu", "-k", "test_quantize_on_another_device", "-rs")
    result.stdout.fnmatch_lines(["*needs two GPUs*"])
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0 and not outcomes.get("passed") and not outcomes.get("failed"), outcomes

"""Repository root conftest: lets the suites run from a checkout.

``pytest --qconform`` collects the suites from the installed ``pytest_qconform.suites``
package (from a checkout: ``pip install -e .``, which maps it to ``suites/``). Without
``--qconform`` the repository's own tests run, and ``suites/`` is left alone, so a plain
``pytest`` here never imports a suite module under a second name. It also keeps the wing's
sweeps of GPU kernel configurations off a CPU unless ``--kernel-sweeps`` asks, and runs the
project's tests without a GPU in Triton's interpreter, whichever folder is given (below).
"""

import os
from pathlib import Path

import pytest

_HERE = Path(__file__).parent
_NOT_TESTS = {
    _HERE / "suites",
    _HERE / "reference",
    _HERE / "examples",
    _HERE / "bench",
    _HERE / "triton-nf4" / "bench",
}


def pytest_ignore_collect(collection_path, config):
    if collection_path in _NOT_TESTS and not config.getoption("qconform", default=False):
        return True
    return None


# The wing's sweeps of GPU kernel configurations (``kernel_sweep`` tests in
# triton-nf4/tests/test_kernels.py: every word, rows and tensor-core kernel configuration the GPU
# meets). On a GPU they compile and take seconds, and always run. On a CPU Triton's interpreter
# runs them in 5-80 s a test, about 300 s together on the 2-core machine, a third of the README's
# test command; there they skip, saying how to run them, unless ``--kernel-sweeps`` is given
# (``nox -s kernel-sweeps``, which ``.ci/run`` runs on every stop). Here, not in a conftest of
# triton-nf4/tests: a second top-level ``conftest`` module would shadow tests/conftest.py, which
# tests import by that name.
SWEEPS_OPTION = "--kernel-sweeps"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        SWEEPS_OPTION,
        action="store_true",
        default=False,
        help="run the kernel configuration sweeps in Triton's interpreter on a CPU (minutes; nox -s kernel-sweeps)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kernel_sweep: a sweep of GPU kernel configurations (on a CPU only with --kernel-sweeps)"
    )
    # The project's tests without a GPU run our kernels in Triton's interpreter, which must be
    # on before triton is first imported. tests/conftest.py sets it when tests/ is collected;
    # here it is also set for the wing's tests run alone (``pytest triton-nf4/tests``), whose
    # files would otherwise import triton compiled and fail ("Cannot call @triton.jit'd
    # outside of the scope of a kernel"). A --qconform run has the wing's plugin decide.
    if not config.getoption("qconform", default=False):
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption(SWEEPS_OPTION, default=False):
        return
    sweeps = [item for item in items if item.get_closest_marker("kernel_sweep") is not None]
    if not sweeps:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="a sweep of GPU kernel configurations in Triton's interpreter (minutes on a CPU): "
        f"nox -s kernel-sweeps runs it ({SWEEPS_OPTION}), and .ci/run does"
    )
    for item in sweeps:
        item.add_marker(skip)

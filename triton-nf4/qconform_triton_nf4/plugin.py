"""The Triton wing's own pytest plugin: our NF4 backend plugs into pytest-qconform as a
downstream backend does, through entry points (``pytest_qconform.backends`` for the
adapter, ``pytest11`` for this module), so the core names no backend.

What the wing needs of a session, and only under ``--qconform``: Triton's interpreter set
up before any conftest.py imports triton on a machine without a GPU (``mode``), and the
background compilation of its kernels on a GPU (``warmup``). Its own option, in its own
group, as a pytest plugin owns its options: ``--qconform-record-kernel-calls``.
"""

from __future__ import annotations

import pytest

RECORD_OPTION = "--qconform-record-kernel-calls"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qconform-triton-nf4", "qconform-triton-nf4: our Triton NF4 backend")
    group.addoption(
        RECORD_OPTION,
        default=None,
        metavar="FILE",
        help="MAINTAINERS: write the calls this run makes to our Triton kernels to FILE (the "
        "warm-up's call log, see nox -s kernel-calls); only with --qconform",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Before any conftest.py is imported: a conftest that imports triton (or bitsandbytes)
    must find it already in interpreter mode on a GPU-less ``--qconform`` run."""
    namespace = early_config.known_args_namespace
    if getattr(namespace, "qconform", False):
        from qconform_triton_nf4 import mode

        mode.prepare(True, getattr(namespace, "qconform_simulate", None))


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """After the core has probed the machine (the warm-up asks the probe for the GPU)."""
    if not config.getoption("qconform", default=False):
        if config.getoption("qconform_record_kernel_calls") is not None:
            raise pytest.UsageError(
                f"{RECORD_OPTION} only works with --qconform, which is missing: without it pytest-qconform "
                "runs nothing. Add --qconform to run the conformance suites, or drop the option."
            )
        return
    from qconform_triton_nf4 import warmup

    warmup.start_warmup(config)

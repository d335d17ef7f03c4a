"""The Triton wing's own pytest plugin: our NF4 backend plugs into pytest-qconform as a
downstream backend does, through entry points (``pytest_qconform.backends`` for the
adapter, ``pytest11`` for this module), so the core names no backend.

What the wing needs of a session, and only under ``--qconform``: Triton's interpreter set
up before any conftest.py imports triton on a machine without a GPU (``mode``), and the
background compilation of its kernels on a GPU (``warmup``).
"""

from __future__ import annotations

import pytest


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
    if config.getoption("qconform", default=False):
        from qconform_triton_nf4 import warmup

        warmup.start_warmup(config)

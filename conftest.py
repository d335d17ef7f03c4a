"""Repository root conftest: lets the suites run from a checkout.

``pytest --qconform`` collects the suites from the installed ``pytest_qconform.suites``
package (from a checkout: ``pip install -e .``, which maps it to ``suites/``). Without
``--qconform`` the repository's own tests run, and ``suites/`` is left alone, so a plain
``pytest`` here never imports a suite module under a second name.
"""

from pathlib import Path

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

"""Sessions for pytest-qconform: ``nox -s matrix`` merges the committed run reports."""
from __future__ import annotations

import nox

# The standard library's venv: no extra tool to install, the same as the README's setup; sessions with
# python=False (matrix) create no environment at all.
nox.options.default_venv_backend = "venv"


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Merge reports/ into reports/MATRIX.md, reports/matrix.png and the README matrix.

    Runs in the current environment (pytest-qconform and matplotlib installed): the
    merge reads JSON only. Pass report files or folders to merge others:
    ``nox -s matrix -- path/to/reports``.
    """
    session.run("python", "-m", "pytest_qconform.matrix", *(session.posargs or ["reports/"]),
                "--readme", "README.md", "--out", "reports/MATRIX.md", "--png", "reports/matrix.png")

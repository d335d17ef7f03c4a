"""The browsable matrix: one self-contained HTML file (reports/site/index.html).

A reader answers "does NF4 at blocksize 128 in bf16 work on sm90 with bitsandbytes 0.50?"
by choosing filters, not by searching a thousand lines of MATRIX.md, and reaches a cell's
evidence (cases, worst multiple, known failure, repro, reports, versions) by clicking it.

One file, nothing fetched at view time: the CSS, the script and the data are inlined, so a
CI job can publish it as an artefact or on Pages, and it opens from disk. The data is
``site_data.page_data`` (the merged model serialised), embedded gzip-compressed and base64
encoded: as JSON it is 1.8 MB for the committed reports, most of it reasons and commands
repeated cell after cell; compressed the page is about a tenth of that. The page decodes it
with the browser's ``DecompressionStream`` (Chromium 80, Firefox 113, Safari 16.4).
The template, style and script are package data (``site_assets/``), kept apart so each
reads as what it is. Deterministic: the same reports give the same bytes (gzip without a
timestamp).
"""

from __future__ import annotations

import base64
import gzip
import json
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_qconform.matrix.model import Matrix
from pytest_qconform.matrix.site_data import page_data
from pytest_qconform.report.atomic import write_text_atomically
from pytest_qconform.report.sections import Section

_ASSETS = "site_assets"


def _asset(name: str) -> str:
    return resources.files("pytest_qconform.matrix").joinpath(_ASSETS, name).read_text(encoding="utf-8")


def encode_data(data: dict[str, Any]) -> str:
    """The page's data as the page embeds it: JSON (keys sorted), gzip (no timestamp), base64."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return base64.b64encode(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0)).decode("ascii")


def decode_data(page: str) -> dict[str, Any]:
    """The data embedded in a page written by ``render_page`` (for tests and tools)."""
    start = page.index('<script id="qconform-data" type="application/gzip-base64">')
    payload = page[page.index(">", start) + 1 : page.index("</script>", start)]
    data: dict[str, Any] = json.loads(gzip.decompress(base64.b64decode(payload.strip())))
    return data


def render_page(data: dict[str, Any]) -> str:
    """The page's HTML around ``data`` (``site_data.page_data``)."""
    page = _asset("page.html")
    parts = {
        "/*QCONFORM_CSS*/": _asset("page.css"),
        "/*QCONFORM_JS*/": _asset("page.js"),
        "QCONFORM_GENERATOR": str(data.get("generator", "pytest-qconform")),
        "QCONFORM_DATA": encode_data(data),
    }
    for marker in parts:
        if page.count(marker) != 1:  # a template edit that drops or repeats a marker breaks the page silently
            raise ValueError(f"site_assets/page.html: expected the marker {marker} once, found {page.count(marker)}")
    # One pass, so that nothing inserted (a script, a report's text) is searched for markers again.
    return re.sub("|".join(re.escape(marker) for marker in parts), lambda found: parts[found.group(0)], page)


def write_site(matrix: Matrix, path: Path, sections: Sequence[Section] = ()) -> Path:
    """Write the page of ``matrix`` to ``path`` (folders created, atomically); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, render_page(page_data(matrix, sections)))
    path.chmod(0o644)  # the atomic writer's temp file is private (0600); a page is published, served by another user
    return path

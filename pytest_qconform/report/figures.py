"""Saving matplotlib figures reproducibly (same data, same PNG bytes), atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_qconform.report.atomic import write_bytes_atomically


def write_figure_png(fig: Any, png_path: str | Path) -> Path:
    """Save a matplotlib figure as PNG at ``png_path`` (folders created), atomically and
    without the matplotlib version in its metadata, so that the same data gives the same
    bytes (``nox -s matrix`` promises that of its heatmap)."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(png_path, buffer.getvalue())
    return png_path

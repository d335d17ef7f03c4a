"""The repro command of a known failure, found from a cell's reason.

A report's known-failure cell carries the entry's reason and link
(``known failure (<link>): <reason> [<file:line>]``, ``KnownFailure.xfail_reason``) but not
its ``repro``, the minimal reproduction a reader wants beside it. The packaged registry
(``pytest_qconform/session/known_failures.toml``) has it: this module reads the registry's
fields with ``tomllib`` and matches the text exactly, so an entry edited since the report
was written matches nothing rather than the wrong thing. It does not import
``session.known_failures``, which validates entries against the hardware targets and so
imports the session and torch: the matrix reads JSON and TOML only. Entries from a runner's
own ``--qconform-known-failures`` file are not known here; their cells show no repro.
"""

from __future__ import annotations

import tomllib
from importlib import resources


def registry_repros(text: str | None = None) -> dict[str, str]:
    """``known failure (<link>): <reason>`` -> repro, for every entry of the registry
    (``text``: a known-failures TOML document; default: the packaged one)."""
    if text is None:
        text = resources.files("pytest_qconform.session").joinpath("known_failures.toml").read_text(encoding="utf-8")
    entries = tomllib.loads(text).get("failure", [])
    return {
        f"known failure ({entry['link']}): {entry['reason']}": entry["repro"]
        for entry in entries
        if isinstance(entry, dict) and all(isinstance(entry.get(k), str) for k in ("link", "reason", "repro"))
    }


NOT_RUN_PREFIX = "[NOTRUN] "  # pytest's prefix of an xfail(run=False) reason: an entry with ends_process = "yes"


def repro_for(reason: str, repros: dict[str, str]) -> str | None:
    """The registry's repro for a known-failure cell ``reason``, None when no entry says it."""
    reason = reason.removeprefix(NOT_RUN_PREFIX)
    return repros.get(reason.rsplit(" [", 1)[0]) if reason.endswith("]") else None

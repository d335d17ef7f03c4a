"""The repro command of a known failure, found from a cell's reason.

A report's known-failure cell carries the entry's reason and link
(``known failure (<link>): <reason> [<file:line>]``, ``KnownFailure.xfail_reason``) but not
its ``repro``, the minimal reproduction a reader wants beside it. The packaged registry
(``pytest_qconform/session/known_failures.toml``) has it: this module reads the registry's
fields with ``tomllib`` and matches the text exactly; an entry narrowed since the report was
written (its reason extended or rewritten, issue 53) is still found by its link, where one
entry of that link shares the longest start with the report's reason, at least
``SAME_START`` characters of it, or where it is the link's only entry. Anything less certain
matches nothing rather than the wrong thing. It does not import
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


SAME_START = 60  # characters a narrowed entry's reason shares with the report's, at least


def _link(text: str) -> str:
    """``<link>`` of ``known failure (<link>): <reason>`` (a link may hold parentheses)."""
    return text[len("known failure (") : text.find("): ")] if "): " in text else ""


def _shared_start(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def repro_for(reason: str, repros: dict[str, str]) -> str | None:
    """The registry's repro for a known-failure cell ``reason``, None when no entry says it."""
    reason = reason.removeprefix(NOT_RUN_PREFIX)
    if not reason.endswith("]"):
        return None
    text = reason.rsplit(" [", 1)[0]
    if text in repros:
        return repros[text]
    link = _link(text)
    same_link = [key for key in repros if link and _link(key) == link]
    if len(same_link) == 1:
        return repros[same_link[0]]
    ranked = sorted(((_shared_start(text, key), key) for key in same_link), reverse=True)
    if ranked and ranked[0][0] >= len(f"known failure ({link}): ") + SAME_START:
        if len(ranked) == 1 or ranked[0][0] > ranked[1][0]:
            return repros[ranked[0][1]]
    return None

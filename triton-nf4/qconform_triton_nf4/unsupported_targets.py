"""GPU archs a Triton release cannot compile for at all (``unsupported_targets.toml``).

Two readers: the compile check, which expects each listed arch to be rejected with the
recorded message (and fails the day it is not), and the ``triton-nf4`` adapter, which
reports itself unavailable on such a device with the reason instead of failing every test
on the first compile.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from pytest_qconform.hardware import archs

UNSUPPORTED_TARGETS = Path(__file__).with_name("unsupported_targets.toml")


@dataclass(frozen=True)
class Unsupported:
    """An arch a Triton release rejects as a target."""

    arch: str
    triton: str  # the exact version the entry was verified with
    message: str  # what the compile error for the arch contains
    reason: str


def unsupported_targets(path: Path = UNSUPPORTED_TARGETS) -> dict[str, Unsupported]:
    """The entries of ``path`` by arch; ValueError naming the file and entry for a bad one."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None
    out = {}
    for index, entry in enumerate(data.get("target", [])):
        try:
            for arch in entry["archs"]:
                if arch not in archs.KNOWN_ARCHS:
                    raise ValueError(f"unknown arch {arch!r}")
                out[arch] = Unsupported(arch, str(entry["triton"]), str(entry["message"]), str(entry["reason"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}: [[target]] {index + 1}: needs archs (known archs), triton, message and "
                f"reason: {type(exc).__name__}: {exc}"
            ) from None
    return out


def rejection(arch: str, triton_version: str | None) -> Unsupported | None:
    """The entry saying ``triton_version`` rejects ``arch``, or None."""
    entry = unsupported_targets().get(arch)
    return entry if entry is not None and entry.triton == triton_version else None

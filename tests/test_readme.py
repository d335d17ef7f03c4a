"""The README is a newcomer's first page: what it tells them to type works from a fresh clone."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_running_it_says_to_activate_the_virtualenv_before_its_commands():
    """The set-up installs into .venv; the table's bare ``nox`` and ``python`` need it active
    (a newcomer met "nox: command not found" and "No module named torch")."""
    section = _section("Running it")
    table = section.index("| command |")
    assert "source .venv/bin/activate" in section[:table]
    commands = [line.split("`")[1] for line in section[table:].splitlines()[2:] if line.startswith("| `")]
    assert commands and all(c.split()[0] in ("pytest", "python", "nox") for c in commands)

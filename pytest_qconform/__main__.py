"""``python -m pytest_qconform doctor|check`` (or ``qconform doctor|check``).

``doctor`` prints the probe: the same record the run header prints, as a human-readable
report or as JSON, so a runner's operator can see what the suite will find before
running it. ``check`` is the report gate a CI job applies to a run's report
(``pytest_qconform.report.gate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from pytest_qconform.hardware.probe import BackendStatus, probe_hardware


def doctor(simulate: str | None, as_json: bool) -> int:
    try:
        probe = probe_hardware(simulate)
    except ValueError as exc:
        print(f"qconform doctor: {exc}", file=sys.stderr)
        return 2
    if not probe.has_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from pytest_qconform.backends import registry
    from pytest_qconform.hardware.startup_notes import captured

    statuses = []
    for name, factory in sorted(registry.discover().items()):
        with captured() as notes:  # import-time warnings: summed up in one line, kept in --json
            try:
                available = factory().availability()
                status = BackendStatus(name, available.available, available.version, available.reason)
            except Exception as exc:  # noqa: BLE001 - a broken adapter is reported, not raised
                status = BackendStatus(name, False, None, f"adapter failed: {type(exc).__name__}: {exc}")
        statuses.append(dataclasses.replace(status, notes=tuple(notes)))
    probe = probe.with_backends(tuple(statuses))
    print(probe.to_json() if as_json else "\n".join(probe.lines()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qconform", description="pytest-qconform tools")
    sub = parser.add_subparsers(dest="command", required=True)
    doc = sub.add_parser("doctor", help="print what hardware, software and backends this machine has")
    doc.add_argument("--json", action="store_true", help="print JSON instead of text")
    doc.add_argument(
        "--simulate",
        default=os.environ.get("QCONFORM_SIMULATE"),
        metavar="ARCH",
        help="testing aid: pretend to be ARCH (e.g. gfx1200)",
    )
    sub.add_parser(
        "check",
        add_help=False,
        help="require things of a run report (CI gate); see python -m pytest_qconform check --help",
    )
    args, rest = parser.parse_known_args(argv)
    if args.command == "check":
        from pytest_qconform.report import gate

        return gate.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return doctor(args.simulate, args.json)


if __name__ == "__main__":
    sys.exit(main())

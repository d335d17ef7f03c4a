"""The known-failure registry: parsing (errors name file and line) and strict xfail in runs."""

import json
import shutil

import pytest

from pytest_qconform.session import known_failures
from pytest_qconform.session.known_failures import KnownFailuresError, parse
from pytest_qconform.vocabulary import CaseKey

ENTRY = """
[[failure]]
backend = "fake"
versions = ">=1.0,<2"
arch = "cpu"
check = "dequantize"
reason = "dequantize returns garbage"
link = "https://example.invalid/issue/1"
repro = "python -c 'import fake; fake.dequantize()'"
"""

SUITE = """
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_dequantize(qtarget, qbackend):
    assert False, "wrong numbers"

@pytest.mark.qconform_operation("quantize")
def test_quantize(qtarget, qbackend):
    pass
"""

BACKENDS = ["--qconform-backend=fake", "--qconform-backend=missing", "-p", "no:cacheprovider"]


def entry(**changes: str) -> str:
    """ENTRY with keys replaced (value None drops the key) or added."""
    lines = ENTRY.strip().splitlines()
    for key, value in changes.items():
        lines = [line for line in lines if not line.startswith(f"{key} =")]
        if value is not None:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def run_with(pytester: pytest.Pytester, toml_text: str, *args: str) -> tuple[pytest.RunResult, dict]:
    pytester.makefile(".toml", runner_failures=toml_text)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest(
        str(pytester.path / "test_suite.py"),
        "--qconform",
        *BACKENDS,
        "--qconform-known-failures=runner_failures.toml",
        "--qconform-report-dir=out",
        *args,
    )
    reports = list((pytester.path / "out").glob("*.json"))
    assert len(reports) == 1, reports
    data = json.loads(reports[0].read_text())
    return result, {(c["backend"], c["operation"]): c for c in data["cells"]}


# ---------------------------------------------------------------- parsing


def test_a_complete_entry_parses_with_its_line() -> None:
    (failure,) = parse("# comment\n" + ENTRY, "mine.toml")
    assert (failure.backend, failure.arch, failure.check, failure.format, failure.dtype) == (
        "fake",
        "cpu",
        "dequantize",
        "*",
        "*",
    )
    assert failure.source == "mine.toml:3"  # the [[failure]] header, after the comment and blank line
    assert "1.5" in failure.versions and "2.0" not in failure.versions


def test_the_packaged_registry_is_valid() -> None:
    assert all(f.source.startswith(known_failures.PACKAGED) for f in known_failures.load([]))


def test_an_unknown_backend_name_is_allowed() -> None:
    (failure,) = parse(entry(backend='"some-backend-this-runner-lacks"'), "f.toml")
    assert failure.backend == "some-backend-this-runner-lacks"


@pytest.mark.parametrize(
    "changes, line, words",
    [
        ({"versions": '"bogus range"'}, 8, "versions 'bogus range' is not a PEP 440 range"),
        ({"color": '"red"'}, 9, "unknown key 'color'"),
        ({"reason": '""'}, 8, "reason must be a non-empty string"),
        ({"check": "3"}, 8, "check must be a non-empty string"),
        ({"arch": '"gfx9999"'}, 8, "arch 'gfx9999' is not a known arch"),
        ({"repro": None}, 1, "missing repro"),
    ],
)
def test_a_malformed_entry_names_file_and_line(changes: dict, line: int, words: str) -> None:
    # entry() moves a changed key to the end (line 8) and appends a new one (line 9).
    with pytest.raises(KnownFailuresError, match=f"^f.toml:{line}: .*{words}"):
        parse(entry(**changes), "f.toml")


def test_the_second_entry_is_blamed_not_the_first() -> None:
    text = ENTRY + "\n# second\n" + entry(versions='"~~1"')
    with pytest.raises(KnownFailuresError, match=r"^f.toml:\d+: versions"):
        parse(text, "f.toml")
    lines = text.splitlines()
    with pytest.raises(KnownFailuresError) as caught:
        parse(text, "f.toml")
    blamed = int(str(caught.value).split(":")[1])
    assert lines[blamed - 1].startswith('versions = "~~1"')


def test_invalid_toml_names_the_line() -> None:
    with pytest.raises(KnownFailuresError, match=r"^f.toml:3: not valid TOML"):
        parse("[[failure]]\nbackend = 'x'\nversions = \n", "f.toml")


def test_a_single_table_instead_of_an_array_is_explained() -> None:
    with pytest.raises(KnownFailuresError, match=r"write \[\[failure\]\], not \[failure\]"):
        parse(ENTRY.replace("[[failure]]", "[failure]"), "f.toml")


def test_star_versions_and_dev_builds_match() -> None:
    (failure,) = parse(entry(versions='"*"'), "f.toml")
    key = CaseKey("fake", "dequantize", "nf4-b64", "bf16", "cpu")
    assert failure.matches(key, "0.1.dev3", ("cpu", "x86_64"), "test_x")
    (ranged,) = parse(entry(versions='">=1.0"'), "f.toml")
    assert ranged.matches(key, "1.1.0.dev0", ("cpu",), "test_x")
    assert not ranged.matches(key, "0.9", ("cpu",), "test_x")
    assert not ranged.matches(key, None, ("cpu",), "test_x")
    assert not ranged.matches(key._replace(operation="matmul"), "1.1", ("cpu",), "test_x")
    assert not ranged.matches(key, "1.1", ("rocm", "gfx1200", "rdna4"), "test_x")


def test_cpu_capability_narrows_cpu_targets_only() -> None:
    """bitsandbytes' CPU kernels differ by CPU level: an AVX512-only failure must not be
    expected on an AVX2 runner (it would pass there, a strict-xfail failure)."""
    (failure,) = parse(entry(arch='"x86_64"', cpu_capability='"AVX512"'), "f.toml")
    key = CaseKey("fake", "dequantize", "nf4-b64", "bf16", "cpu")
    assert failure.matches(key, "1.1", ("cpu", "x86_64"), "test_x", "AVX512")
    assert not failure.matches(key, "1.1", ("cpu", "x86_64"), "test_x", "AVX2")
    assert not failure.matches(key, "1.1", ("cpu", "x86_64"), "test_x", None)
    (gpu,) = parse(entry(arch='"sm90"', cpu_capability='"AVX512"'), "f.toml")
    assert not gpu.matches(key, "1.1", ("cuda", "sm90", "hopper"), "test_x", "AVX512")


# ---------------------------------------------------------------- in a run


def test_matches_are_known_failures_and_an_unexpected_pass_is_a_fail(fake_backend_project: pytest.Pytester) -> None:
    # Two entries: test_dequantize fails as listed; test_quantize is listed but passes.
    result, cells = run_with(fake_backend_project, ENTRY + "\n" + entry(check='"quantize"'), "-rx")
    result.assert_outcomes(xfailed=1, failed=1, skipped=2)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    known = cells[("fake", "dequantize")]
    assert known["verdict"] == "known-failure"
    assert "dequantize returns garbage" in known["reason"] and "https://example.invalid/issue/1" in known["reason"]
    xpassed = cells[("fake", "quantize")]
    assert xpassed["verdict"] == "fail"
    assert "passed unexpectedly" in xpassed["first_failure"]["message"]
    assert cells[("missing", "dequantize")]["verdict"] == "unavailable"


def test_a_known_failure_is_formatted_natively_and_a_new_failure_in_full(fake_backend_project: pytest.Pytester) -> None:
    """pytest's default traceback parses every frame's source file (costly through torch or
    transformers); a known failure's traceback is read by no one, a new failure's is."""
    fake_backend_project.makepyfile(test_suite=SUITE.replace("    pass", "    assert False, 'new failure'"))
    fake_backend_project.makefile(".toml", runner_failures=ENTRY)
    recorder = fake_backend_project.inline_run(
        str(fake_backend_project.path / "test_suite.py"),
        "--qconform",
        *BACKENDS,
        "--qconform-no-report",
        "--qconform-known-failures=runner_failures.toml",
    )
    calls = {
        r.nodeid.split("::")[-1].split("[")[0]: r
        for r in recorder.getreports("pytest_runtest_logreport")
        if r.when == "call" and "fake" in r.nodeid
    }
    known, new = str(calls["test_dequantize"].longrepr), str(calls["test_quantize"].longrepr)
    assert hasattr(calls["test_dequantize"], "wasxfail")
    assert "Traceback (most recent call last)" in known and "AssertionError: wrong numbers" in known
    assert "Traceback (most recent call last)" not in new and "E       AssertionError: new failure" in new


def near_misses() -> list[str]:
    """Entries that each differ from the failing test in one field only."""
    return [
        entry(versions='"<1.0"'),
        entry(arch='"gfx1200"'),
        entry(backend='"other"'),
        entry(format='"fp4*"'),
        entry(test='"test_other*"'),
        entry(dtype='"bf16"'),
    ]


def test_entries_that_do_not_match_hide_nothing(fake_backend_project: pytest.Pytester) -> None:
    result, cells = run_with(fake_backend_project, "\n".join(near_misses()))
    result.assert_outcomes(passed=1, failed=1, skipped=2)
    assert cells[("fake", "dequantize")]["verdict"] == "fail"
    assert "wrong numbers" in cells[("fake", "dequantize")]["first_failure"]["message"]
    assert cells[("fake", "quantize")]["verdict"] == "pass"


def test_entries_that_could_match_here_and_mark_nothing_are_reported_stale(
    fake_backend_project: pytest.Pytester,
) -> None:
    """array-api-tests warns about an expectation that matches no test: a renamed test or a
    glob gone wrong keeps an entry that says nothing. Entries for another backend, version or
    device are not this run's to judge."""
    # The last three of near_misses() could match here and mark nothing; a check this run did not
    # collect is not judged, and the entry that marks the failing test is not stale.
    text = "\n".join([*near_misses(), entry(check='"matmul"'), ENTRY])
    result, _ = run_with(fake_backend_project, text)
    headers = [n for n, line in enumerate(text.splitlines(), 1) if line == "[[failure]]"]
    stale_lines = [f"runner_failures.toml:{headers[i]} (fake dequantize)" for i in (3, 4, 5)]
    result.stdout.fnmatch_lines(
        ["qconform: 3 known-failure entries for this run's backends and device marked no collected test*"]
    )
    assert "; ".join(stale_lines) in result.stdout.str()
    (path,) = (fake_backend_project.path / "out").glob("*.json")
    stale = json.loads(path.read_text())["stale_known_failures"]
    assert [f"{e['source']} ({e['backend']} {e['check']})" for e in stale] == stale_lines


def test_an_entry_that_covers_a_test_an_earlier_entry_marked_is_not_stale(
    fake_backend_project: pytest.Pytester,
) -> None:
    """The first entry that covers a test marks it; a later one that covers it too (an entry
    for every CPU after one for an AVX512 CPU's kernels) matched something and is not named."""
    later = entry(arch='"*"', reason='"the later entry"')
    result, _ = run_with(fake_backend_project, ENTRY + "\n" + later, "-rx")
    result.assert_outcomes(xfailed=1, passed=1, skipped=2)
    assert "marked no collected test" not in result.stdout.str()
    assert "dequantize returns garbage" in result.stdout.str() and "the later entry" not in result.stdout.str()


@pytest.mark.parametrize(("profile", "stale"), [('"thorough"', False), ('"ci"', True), (None, True)])
def test_an_entry_for_the_thorough_profile_is_judged_in_its_runs_only(
    fake_backend_project: pytest.Pytester, profile: str | None, stale: bool
) -> None:
    """An entry whose tests only ``thorough`` draws names its profile, and a ``ci`` run that
    collects none of them does not call it stale; without the key, or naming ``ci``, it is."""
    unmatched = entry(test='"test_dequantize_drawn_only_in_thorough*"', profile=profile)
    result, _ = run_with(fake_backend_project, ENTRY + "\n" + unmatched)
    assert ("marked no collected test" in result.stdout.str()) is stale


def test_a_profile_that_is_not_one_names_its_line() -> None:
    with pytest.raises(KnownFailuresError, match=r"t\.toml:\d+: profile must be one of ci, thorough"):
        parse(entry(profile='"nightly"'), "t.toml")


def test_a_run_narrowed_by_k_judges_no_entry(fake_backend_project: pytest.Pytester) -> None:
    result, _ = run_with(fake_backend_project, entry(format='"fp4*"'), "-k", "quantize or dequantize")
    assert "marked no collected test" not in result.stdout.str()


def test_a_malformed_runner_file_stops_the_run_at_start_up(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makefile(".toml", runner_failures="# mine\n" + entry(versions='"bogus"'))
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest(
        str(fake_backend_project.path),
        "--qconform",
        "--qconform-no-report",
        *BACKENDS,
        "--qconform-known-failures=runner_failures.toml",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*runner_failures.toml:9: versions 'bogus' is not a PEP 440 range*"])
    assert "collected" not in result.stdout.str()


def test_a_missing_runner_file_is_an_error(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest(
        str(fake_backend_project.path),
        "--qconform",
        "--qconform-no-report",
        *BACKENDS,
        "--qconform-known-failures=nope.toml",
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--qconform-known-failures: no such file: nope.toml*"])


def test_an_entry_scoped_by_message_judges_the_failure_not_the_instance(fake_backend_project: pytest.Pytester) -> None:
    """A ``message`` entry names a condition of drawn values: a failure whose message matches
    is a known failure, another failure stays a failure, and a pass (the condition not drawn)
    is a pass, not an unexpected one."""
    matching = entry(message='"wrong numbers"')
    result, cells = run_with(fake_backend_project, matching + "\n" + entry(check='"quantize"', message='"x"'))
    result.assert_outcomes(xfailed=1, passed=1, skipped=2)
    assert cells[("fake", "dequantize")]["verdict"] == "known-failure"
    assert cells[("fake", "quantize")]["verdict"] == "pass"

    shutil.rmtree(fake_backend_project.path / "out")  # run_with reads the one report there
    result, cells = run_with(fake_backend_project, entry(message='"other numbers"'))
    result.assert_outcomes(failed=1, passed=1, skipped=2)
    assert cells[("fake", "dequantize")]["verdict"] == "fail"
    result.stdout.fnmatch_lines(["*AssertionError: wrong numbers*"])


def test_a_message_that_is_no_regular_expression_names_its_line() -> None:
    with pytest.raises(KnownFailuresError, match=r"t\.toml:\d+: message '\(' is not a regular expression"):
        parse(entry(message='"("'), "t.toml")

"""Runs PyTorch's RPC test suites against ``ferry.rpc`` and compares the
outcome with the checked-in lists.

- ``expected.txt``: the tests that pass (``Class.test_name``, one a line).
- ``skips.txt``: the tests not run, each with its reason
  (``Class.test_name: reason``, or a glob: ``CudaRpcTest.*: reason``).

``--select expected`` (what ``cargo xtask test`` runs) runs the expected
passes only and fails if any of them does not pass. ``--select all`` runs
every test not skipped, reports the counts per suite, every test that
passes without being listed (so the list can grow) and every listed one
that did not pass; ``--update`` then rewrites ``expected.txt`` with what
passed. ``--report FILE`` writes each test's outcome, with the first
line of a failure's error, as tab-separated text.

Exit status: 0 when every expected pass passed (and, with ``--select
all``, whatever else happened); 1 otherwise; 2 for a malformed list.
Arguments after ``--`` go to pytest as they are (``-k``, ``-x``).
"""

import argparse
import fnmatch
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SUITES_FILE = os.path.join(HERE, "suites.py")
EXPECTED_FILE = os.path.join(HERE, "expected.txt")
SKIPS_FILE = os.path.join(HERE, "skips.txt")

#: The bound on one test (all its ranks), in seconds: PyTorch's
#: ``MultiProcessTestCase`` kills the ranks after it and fails the test.
DEFAULT_TEST_TIMEOUT_S = 120


class ListError(Exception):
    """``expected.txt`` or ``skips.txt`` is malformed."""


def _lines(path):
    """The meaningful lines of ``path`` (no blanks, no ``#`` comments),
    with their line numbers."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if line:
                out.append((n, line))
    return out


_ID = re.compile(r"^[A-Za-z_]\w*\.test_\w+$")
#: A line of skips.txt names a test, or tests by a glob (``*`` any run of
#: characters): ``RpcTest.test_profiler_*``, ``CudaRpcTest.*``.
_PATTERN = re.compile(r"^[A-Za-z_][\w*]*\.[\w*]+$")


def read_expected(path=EXPECTED_FILE):
    """The set of test ids in ``expected.txt``."""
    ids = set()
    for n, line in _lines(path):
        if not _ID.match(line):
            raise ListError(f"{path}:{n}: not a test id (Class.test_name): {line!r}")
        ids.add(line)
    return ids


def read_skips(path=SKIPS_FILE):
    """``{test id or "Class.*": reason}`` from ``skips.txt``."""
    skips = {}
    for n, line in _lines(path):
        test, sep, reason = line.partition(":")
        test, reason = test.strip(), reason.strip()
        if not sep or not reason or not _PATTERN.match(test):
            raise ListError(f"{path}:{n}: expected 'Class.test_name: reason', got {line!r}")
        if test in skips:
            raise ListError(f"{path}:{n}: {test} is listed twice")
        skips[test] = reason
    return skips


def skip_reason(test_id, skips):
    """Why ``test_id`` is skipped (``None``: it runs): its own line of
    ``skips.txt``, else the first glob that matches it."""
    if test_id in skips:
        return skips[test_id]
    for pattern, reason in skips.items():
        if "*" in pattern and fnmatch.fnmatchcase(test_id, pattern):
            return reason
    return None


def _first_error_line(longrepr):
    """The most telling line of a failure: the last line naming an
    exception, from the ranks' tracebacks the parent collected."""
    text = str(longrepr)
    found = None
    for line in text.splitlines():
        s = line.strip()
        if re.match(r"^(E\s+)?[\w.]*(Error|Exception|Exit|NotPartOfFerry)\b[:(]?", s) and not s.startswith(
            "E   RuntimeError: Process"
        ):
            found = s
    if found is None:
        lines = [s.strip() for s in text.splitlines() if s.strip()]
        found = lines[-1] if lines else ""
    return found.removeprefix("E").strip()[:300]


class Plugin:
    """The pytest plugin that selects the tests and records outcomes."""

    def __init__(self, select, expected, skips):
        self.select = select
        self.expected = expected
        self.skips = skips
        self.collected = set()
        self.outcomes = {}  # test id -> (outcome, detail)
        self.durations = {}

    @staticmethod
    def test_id(item):
        cls = getattr(item, "cls", None)
        return f"{cls.__name__}.{item.name}" if cls else item.name

    def pytest_collection_modifyitems(self, session, config, items):
        import pytest

        keep, drop = [], []
        for item in items:
            tid = self.test_id(item)
            self.collected.add(tid)
            reason = skip_reason(tid, self.skips)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
            if self.select == "expected" and tid not in self.expected:
                drop.append(item)
            else:
                keep.append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def pytest_runtest_logreport(self, report):
        tid = report.nodeid.split("::")
        tid = ".".join(tid[-2:]) if len(tid) >= 3 else tid[-1]
        if report.when == "call" or report.failed or report.skipped:
            if report.skipped:
                reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
                self.outcomes.setdefault(tid, ("skipped", reason.removeprefix("Skipped: ")))
            elif report.failed:
                self.outcomes[tid] = ("failed", _first_error_line(report.longrepr))
            else:
                self.outcomes.setdefault(tid, ("passed", ""))
        self.durations[tid] = self.durations.get(tid, 0.0) + report.duration


def suite_of(test_id):
    """The PyTorch file a test id's class comes from."""
    import suites

    cls = test_id.split(".", 1)[0]
    for module, names in suites.SUITES:
        if cls in names:
            return f"{module}.py"
    return "?"


def summarize(plugin, filtered):
    """Prints the counts per suite and the differences from the lists;
    returns the regressions (expected passes that did not pass)."""
    per_suite = {}
    for tid, (outcome, _) in plugin.outcomes.items():
        counts = per_suite.setdefault(suite_of(tid), {"passed": 0, "failed": 0, "skipped": 0})
        counts[outcome] += 1
    print("\n== PyTorch's RPC suites against ferry.rpc ==")
    for suite in sorted(per_suite):
        c = per_suite[suite]
        print(f"{suite}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    total = {k: sum(c[k] for c in per_suite.values()) for k in ("passed", "failed", "skipped")}
    # Under a filter (-k), only the expected passes that ran count.
    considered = plugin.expected if not filtered else plugin.expected & set(plugin.outcomes)
    regressions = sorted(
        t for t in considered if plugin.outcomes.get(t, ("missing",))[0] != "passed"
    )
    new = sorted(
        t for t, (o, _) in plugin.outcomes.items() if o == "passed" and t not in plugin.expected
    )
    unknown = sorted(t for t in plugin.expected if t not in plugin.collected)
    for t in new:
        print(f"NEW PASS (add it to expected.txt): {t}")
    for t in regressions:
        outcome, detail = plugin.outcomes.get(t, ("not run", ""))
        print(f"REGRESSION (expected to pass, {outcome}): {t}  {detail}")
    for t in unknown:
        print(f"UNKNOWN (in expected.txt, not a test of the suites): {t}")
    slow = sorted(plugin.durations.items(), key=lambda kv: -kv[1])[:5]
    print("slowest: " + ", ".join(f"{t} {d:.1f}s" for t, d in slow))
    print(f"torch-suites: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return regressions + unknown


def write_report(plugin, path):
    with open(path, "w") as f:
        for tid in sorted(plugin.outcomes):
            outcome, detail = plugin.outcomes[tid]
            d = plugin.durations.get(tid, 0.0)
            f.write(f"{tid}\t{suite_of(tid)}\t{outcome}\t{d:.1f}\t{detail}\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--select", choices=["expected", "all"], default="expected")
    parser.add_argument("--update", action="store_true", help="rewrite expected.txt (with --select all)")
    parser.add_argument("--report", help="write each test's outcome to this file")
    parser.add_argument(
        "--test-timeout",
        type=int,
        default=DEFAULT_TEST_TIMEOUT_S,
        help="seconds one test may take before its ranks are killed",
    )
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args(argv)
    if args.update and args.select != "all":
        parser.error("--update needs --select all")
    try:
        expected, skips = read_expected(), read_skips()
    except ListError as e:
        print(f"torch suites: {e}", file=sys.stderr)
        return 2
    both = sorted(t for t in expected if skip_reason(t, skips))
    if both:
        print(f"torch suites: listed both as expected and as skipped: {both}", file=sys.stderr)
        return 2
    # Read by torch.testing._internal.common_distributed when it is imported.
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.test_timeout)
    sys.path.insert(0, HERE)
    import pytest

    plugin = Plugin(args.select, expected, skips)
    start = time.monotonic()
    code = pytest.main(
        ["-q", "-rN", "-p", "no:cacheprovider", "-p", "no:warnings", SUITES_FILE, *args.pytest_args], plugins=[plugin]
    )
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        print(f"torch suites: pytest stopped ({code!r})", file=sys.stderr)
        return 1
    # Only a run over everything collected can tell a stale line.
    unknown_skips = [] if args.pytest_args else sorted(
        s for s in skips if not any(fnmatch.fnmatchcase(t, s) for t in plugin.collected)
    )
    for s in unknown_skips:
        print(f"UNKNOWN (in skips.txt, not a test of the suites): {s}")
    regressions = summarize(plugin, bool(args.pytest_args))
    print(f"torch suites took {time.monotonic() - start:.0f} s")
    if args.report:
        write_report(plugin, args.report)
    if args.update:
        passed = sorted(t for t, (o, _) in plugin.outcomes.items() if o == "passed")
        with open(EXPECTED_FILE, "w") as f:
            f.write(HEADER)
            f.writelines(f"{t}\n" for t in passed)
        print(f"wrote {len(passed)} expected passes to {EXPECTED_FILE}")
        return 0
    return 1 if regressions or unknown_skips else 0


HEADER = """\
# PyTorch's RPC tests (torch/testing/_internal/distributed/rpc/) that pass
# against ferry.rpc: `cargo xtask test` runs these and fails if one fails.
# Regenerate with `python run.py --select all --update` (see run.py).
"""


if __name__ == "__main__":
    sys.exit(main())

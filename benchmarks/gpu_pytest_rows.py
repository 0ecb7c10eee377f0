"""A pytest plugin of gpu_report's pytest part: each test's outcome, seconds and message as one
JSON line, written the moment the test ends, to the file named by $KONKANIVANI_PYTEST_ROWS.

pytest writes its JUnit XML report only when the session ends, so a run killed at its time limit
kept the outcomes that ``-v`` printed but none of the messages (why a test failed) or times. With
this plugin they survive the kill. gpu_report loads it with ``-p gpu_pytest_rows`` and this folder
on PYTHONPATH; without the variable it writes nothing.
"""
import json
import os

ROWS_ENV = "KONKANIVANI_PYTEST_ROWS"


def _message(report) -> str:
    """The first line that says why: a failure's crash message, a skip's reason."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        text = str(longrepr[-1]).removeprefix("Skipped: ")
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr)
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:240]


def _outcome(report) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return report.outcome  # passed or skipped


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get(ROWS_ENV)
    # A test's row: its call, or the setup or teardown that failed or skipped it.
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    row = {"test": report.nodeid, "outcome": _outcome(report),
           "seconds": round(report.duration, 3), "message": _message(report)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")

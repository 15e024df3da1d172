"""Shared by tests/python and tests/security (pytest loads conftest files up to the rootdir).

Under `.ci/run` (PDGATE_NO_SKIPS=1) a skipped test fails the session: CI has every dependency,
so a skip there means something did not run, and `.ci/run`'s skip registry lists no pytest test.
"""

import os


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PDGATE_NO_SKIPS") != "1" or exitstatus != 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter else []
    if skipped:
        names = ", ".join(r.nodeid for r in skipped)
        print(f"\nFAIL: {len(skipped)} test(s) skipped under PDGATE_NO_SKIPS=1: {names}")
        session.exitstatus = 1

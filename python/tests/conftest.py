"""The package's pytest plugin (installed, pytest finds it by its entry point; from a checkout it
is on PYTHONPATH only), pytester (tests the plugin in a pytest of its own), and CI's rule.

Under CI (the variable ``CI`` set, as ``.ci/run`` sets it) a skipped test fails, with its reason:
a framework that is missing or does not import (``pytest.importorskip``), a binary not found, a
release other than the pinned one. A suite that cannot run there fails instead of passing unseen,
whatever module it is in. A test written for another release than the one a CI run installs is
deselected by that run's command line (marker ``megatron_core_0_19``), never skipped.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

pytest_plugins = ["moe_audit.pytest_plugin", "pytester"]


def _skips_fail_under_ci(report: pytest.CollectReport | pytest.TestReport) -> None:
    if os.environ.get("CI") is None or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI, where every test must run: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
        collector: pytest.Collector) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A module skipped while it is imported (``pytest.importorskip`` at its top)."""
    report: pytest.CollectReport = yield
    _skips_fail_under_ci(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                               call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test skipped by a mark or from its body."""
    report: pytest.TestReport = yield
    _skips_fail_under_ci(report)
    return report

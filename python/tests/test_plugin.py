"""The pytest plugin: the moe_audit_snapshot fixture and --moe-audit-update, run in pytests of
their own (pytester) on the example megatron router. Needs numpy and the moe-audit binary."""

import os

import pytest

import moe_audit

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "megatron_probs_router.py")

TEST = f'''
import runpy
from types import SimpleNamespace

megatron = SimpleNamespace(**runpy.run_path({EXAMPLE!r}))

def renormalised(data, mode):
    tokens, capacity = megatron.route(data, mode)
    return [[(e, w / sum(v for _, v, k in r if k) if k else w, k) for e, w, k in r] for r in tokens], capacity

ROUTER = renormalised if __import__("os").environ.get("CHANGED") else megatron.route

def test_router(moe_audit_snapshot):
    moe_audit_snapshot(ROUTER, name="megatron-probs-py", experts=8, top_k=2)
'''


@pytest.fixture
def suite(pytester, monkeypatch):
    for var in ("MOE_AUDIT_UPDATE", "INSTA_UPDATE", "CI", "CHANGED"):
        monkeypatch.delenv(var, raising=False)
    # The inner pytest imports the package from where this one did (a checkout's python/).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(moe_audit.__file__)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_router=TEST)
    return pytester


def run(suite, *args):
    return suite.runpytest_subprocess("-p", "moe_audit.pytest_plugin", *args)


def test_the_fixture_writes_beside_the_test_then_checks(suite, monkeypatch):
    run(suite).assert_outcomes(passed=1)
    snap = suite.path / "snapshots" / "test_router.snap"
    text = snap.read_text()
    assert text.startswith("# moe-audit routing snapshot"), text
    monkeypatch.setenv("CHANGED", "1")
    failed = run(suite)
    failed.assert_outcomes(failed=1)
    assert "routing changed" in failed.stdout.str() and "--moe-audit-update" in failed.stdout.str()
    assert snap.read_text() == text


def test_the_update_option_rewrites_and_wins_over_the_variables(suite, monkeypatch):
    run(suite).assert_outcomes(passed=1)
    snap = suite.path / "snapshots" / "test_router.snap"
    before = snap.read_text()
    monkeypatch.setenv("CHANGED", "1")
    monkeypatch.setenv("MOE_AUDIT_UPDATE", "1")
    run(suite, "--moe-audit-update=no").assert_outcomes(failed=1)
    assert snap.read_text() == before
    monkeypatch.delenv("MOE_AUDIT_UPDATE")
    run(suite, "--moe-audit-update=new").assert_outcomes(failed=1)
    assert (suite.path / "snapshots" / "test_router.snap.new").read_text() != before
    run(suite, "--moe-audit-update").assert_outcomes(passed=1)
    assert snap.read_text() != before
    run(suite).assert_outcomes(passed=1)


def test_the_option_is_in_the_help(suite):
    assert "--moe-audit-update=[MODE]" in run(suite, "--help").stdout.str()

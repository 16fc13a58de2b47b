"""moe_audit.check on a router of this process: a parsed report, errors that name the router
(never the command that hands its streams over), and nothing left behind."""

import os
import threading

import numpy as np
import pytest

import moe_audit

SIZES = ("--batch", "2", "--seq-len", "8", "--trials", "2")


def top1(data, mode):
    """A causal router: each token to the expert of its largest logit."""
    x = data.reshape(-1, data.shape[-1])
    return moe_audit.routes_from_arrays(x.argmax(-1)[:, None], np.ones((len(x), 1)))


def last_top1(data, mode):
    """A leaking router: every token of a sequence to the top expert of the sequence's last token."""
    batch, seq_len, _ = data.shape
    best = np.repeat(data[:, -1, :].argmax(-1), seq_len)[:, None]
    return moe_audit.routes_from_arrays(best, np.ones((batch * seq_len, 1)))


def test_check_returns_a_report_of_verdicts_per_probe():
    report = moe_audit.check(top1, *SIZES, "--probes", "P,F,D", name="top1", experts=4, top_k=1)
    assert isinstance(report, moe_audit.Report)
    assert (report.exit_code, report.failed, report.leaks) == (0, False, [])
    assert report.verdicts == {"P": "pass", "F": "pass", "D": "pass"}
    document = report.to_dict()
    assert document["routers"][0]["router"] == "top1" and document["options"]["batch"] == 2
    assert [f["probe"] for f in report.findings] == ["P", "F", "D"]
    assert "failed=False" in repr(report)


def test_a_leak_fails_the_report_and_is_named():
    report = moe_audit.check(last_top1, *SIZES, "--probes", "P,F,D", experts=4, top_k=1)
    assert (report.exit_code, report.failed, report.leaks) == (1, True, ["P", "F"])
    assert report.verdicts["D"] == "pass"


def test_format_json_is_taken_and_other_outputs_are_refused():
    assert moe_audit.check(top1, *SIZES, "--probes", "D", "--format", "json", experts=4, top_k=1).verdicts == {
        "D": "pass"}
    for args in (("--format", "text"), ("--format=markdown",), ("--output", "x.json"), ("--github",)):
        with pytest.raises(ValueError, match="is not taken"):
            moe_audit.check(top1, *args, experts=4, top_k=1)


def test_an_error_names_the_router_served_here_not_the_hand_over():
    def one_route(data, mode):
        # top_k is 2 in the handshake, one route per token here: moe-audit refuses the answer.
        tokens = data.shape[0] * data.shape[1]
        return moe_audit.routes_from_arrays(np.zeros((tokens, 1)), np.ones((tokens, 1)))

    with pytest.raises(moe_audit.CheckError) as e:
        moe_audit.check(one_route, "--batch", "1", "--seq-len", "4", "--probes", "D", name="one-route",
                        experts=4, top_k=2)
    assert e.value.exit_code == 2
    assert str(e.value).startswith("router `one-route (served in this Python process)`: "), e.value.stderr
    assert "socket" not in e.value.stderr and "moe-audit-check-" not in e.value.stderr, e.value.stderr


def test_a_usage_error_raises_before_any_router_call_and_leaves_nothing_behind():
    calls = []

    def counted(data, mode):
        calls.append(mode)
        return top1(data, mode)

    threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(moe_audit.CheckError, match="--batch"):
            moe_audit.check(counted, "--batch", "0", experts=4, top_k=1)
        moe_audit.check(counted, *SIZES, "--probes", "D", experts=4, top_k=1)
    assert calls, "the router served the second check of each round"
    assert threading.active_count() == threads and len(os.listdir("/proc/self/fd")) == fds


def test_type_checkers_see_every_name_the_package_loads_on_first_use():
    # moe_audit/__init__.py loads its names lazily (__getattr__) and imports them under
    # TYPE_CHECKING for type checkers (py.typed): the two lists are the same, from the same modules.
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(moe_audit))
    checked = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    seen = {a.name: node.module for node in checked.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert sorted([*seen, "MoeAuditError", "binary"]) == moe_audit.__all__
    for name, where in seen.items():
        # Where it comes from (by name: another test may have reloaded the module since).
        value, home = getattr(moe_audit, name), importlib.import_module(f"moe_audit.{where}")
        assert getattr(value, "__module__", home.__name__) == home.__name__ and hasattr(home, name), name

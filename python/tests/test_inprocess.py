"""moe_audit.check on a router of this process: a parsed report, errors that name the router
(never the command that hands its streams over), and nothing left behind."""

import os
import re
import subprocess
import threading
from typing import Any

import numpy as np
import pytest

import moe_audit

SIZES: dict[str, Any] = {"batch": 2, "seq_len": 8, "trials": 2}

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
    report = moe_audit.check(top1, **SIZES, probes="P,F,D", name="top1", experts=4, top_k=1)
    assert isinstance(report, moe_audit.Report)
    assert (report.exit_code, report.failed, report.leaks) == (0, False, [])
    assert report.verdicts == {"P": "pass", "F": "pass", "D": "pass"}
    document = report.to_dict()
    assert document["routers"][0]["router"] == "top1" and document["options"]["batch"] == 2
    assert [f.probe for f in report.findings] == ["P", "F", "D"]
    assert "failed=False" in repr(report)


def test_findings_are_typed_and_keep_the_report_s_fields():
    report = moe_audit.check(last_top1, **SIZES, probes=["P", "D"], experts=4, top_k=1)
    p = report.finding("P")
    assert isinstance(p, moe_audit.inprocess.Finding)
    assert (p.probe, p.verdict, p.property) == ("P", "leak", "C-length")
    assert p.witness is not None and p.witness == p.fields["witness"]
    assert p.fields == report.to_dict()["routers"][0]["findings"][0]
    assert p.fields["affected"] > 0 and p.note == p.fields["note"]
    with pytest.raises(KeyError, match="no finding of probe 'F': the report has P, D"):
        report.finding("F")
    # A finding read as the dict it was before 0.3.0 still works, with a warning.
    with pytest.warns(DeprecationWarning, match="finding.fields"):
        assert report.findings[1]["verdict"] == "pass"


def test_a_leak_fails_the_report_and_is_named():
    report = moe_audit.check(last_top1, **SIZES, probes="P,F,D", experts=4, top_k=1)
    assert (report.exit_code, report.failed, report.leaks) == (1, True, ["P", "F"])
    assert report.verdicts["D"] == "pass"
    # fail_on: the leaks found fail only when they are listed.
    passed = moe_audit.check(last_top1, **SIZES, probes="P,F,D", fail_on=["drift"], experts=4, top_k=1)
    assert (passed.exit_code, passed.leaks) == (0, ["P", "F"])


def test_every_keyword_is_a_flag_of_exactly_the_commands_that_take_it():
    from moe_audit.inprocess import _OPTIONS

    helps = {c: subprocess.run([moe_audit.binary(), c, "--help"], capture_output=True, text=True, check=True).stdout
             for c in ("check", "model")}
    for key, (flag, commands) in _OPTIONS.items():
        for command, text in helps.items():
            assert (re.search(rf"^\s+{flag}\b", text, re.M) is not None) == (command in commands), (key, command)


def test_the_keywords_reach_the_audit(tmp_path):
    modes = []

    def seen(data, mode):
        modes.append(mode)
        return last_top1(data, mode)

    report = moe_audit.check(seen, batch=2, seq_len=8, trials=3, seed=7, probes=["P", "D"], mode="inference",
                             ranks=2, exhaustive=True, witness_dir=tmp_path, answer_timeout=30, max_memory="8GiB",
                             experts=4, top_k=1)
    options = report.to_dict()["options"]
    assert {k: options[k] for k in ("probes", "batch", "seq_len", "trials", "seed", "ranks", "exhaustive")} == {
        "probes": ["P", "D"], "batch": 2, "seq_len": 8, "trials": 3, "seed": 7, "ranks": 2, "exhaustive": True}
    # The probes' calls are in the mode asked; a few calls of every audit are in the other.
    assert modes.count("inference") > modes.count("train"), modes
    assert report.leaks == ["P"] and [p.name.endswith("-P.json") for p in tmp_path.iterdir()] == [True]
    with pytest.raises(moe_audit.CheckError, match="memory"):
        moe_audit.check(top1, **SIZES, probes="D", max_memory="1KiB", experts=4, top_k=1)


def test_flags_as_strings_still_work_deprecated_and_give_the_same_report():
    typed = moe_audit.check(top1, **SIZES, probes="P,D", seed=3, experts=4, top_k=1)
    with pytest.warns(DeprecationWarning, match="flags as strings are deprecated"):
        strings = moe_audit.check(top1, "--batch", "2", "--seq-len", "8", "--trials", "2", "--probes", "P,D",
                                  "--seed=3", experts=4, top_k=1)
    assert strings.to_dict() == typed.to_dict()


def test_format_json_is_taken_and_other_outputs_are_refused():
    with pytest.warns(DeprecationWarning):
        assert moe_audit.check(top1, "--format", "json", **SIZES, probes="D", experts=4, top_k=1).verdicts == {
            "D": "pass"}
    for args in (("--format", "text"), ("--format=markdown",), ("--output", "x.json"), ("--github",)):
        with pytest.raises(ValueError, match="is not taken"), pytest.warns(DeprecationWarning):
            moe_audit.check(top1, *args, experts=4, top_k=1)


def test_an_option_of_the_other_audit_is_refused_before_anything_runs():
    class WholeModel:
        def serve(self, inp, out):
            raise AssertionError("not served: the options are refused first")

    with pytest.raises(TypeError, match=r"^prefill= is not an option of the audit of a router \(only of a whole "
                       r"model's\)$"):
        moe_audit.check(top1, prefill=4, experts=4, top_k=1)
    with pytest.raises(TypeError, match=r"^mode= is not an option of the audit of a whole model"):
        moe_audit.check(WholeModel(), mode="inference")
    with pytest.raises(TypeError, match=r"^experts=: a whole model describes itself$"):
        moe_audit.check(WholeModel(), experts=4)


def test_an_error_names_the_router_served_here_not_the_hand_over():
    def one_route(data, mode):
        # top_k is 2 in the handshake, one route per token here: moe-audit refuses the answer.
        tokens = data.shape[0] * data.shape[1]
        return moe_audit.routes_from_arrays(np.zeros((tokens, 1)), np.ones((tokens, 1)))

    with pytest.raises(moe_audit.CheckError) as e:
        moe_audit.check(one_route, batch=1, seq_len=4, probes="D", name="one-route", experts=4, top_k=2)
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
            moe_audit.check(counted, batch=0, experts=4, top_k=1)
        moe_audit.check(counted, **SIZES, probes="D", experts=4, top_k=1)
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

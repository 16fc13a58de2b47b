"""Tests of moe_audit.snapshot, pytest style; `python3 python/tests/test_snapshot.py` runs them
without pytest (tests/it/snapshot_cli.rs does, with $MOE_AUDIT_BIN set). Needs numpy and the
moe_audit package (installed, or python/ on PYTHONPATH)."""

import contextlib
import os
import runpy
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

from moe_audit.snapshot import assert_routing_snapshot, routing_snapshot

HERE = os.path.dirname(os.path.abspath(__file__))
# The example router, loaded from its file (it is no module of the package).
megatron = SimpleNamespace(**runpy.run_path(os.path.join(HERE, "..", "examples", "megatron_probs_router.py")))

OPTIONS: dict[str, Any] = dict(name="megatron-probs-py", experts=8, top_k=2)
UPDATE_VARS = ("MOE_AUDIT_UPDATE", "INSTA_UPDATE", "CI")


@contextlib.contextmanager
def env(**values):
    """The update variables set to values (the others unset), restored afterwards."""
    saved = {k: os.environ.get(k) for k in UPDATE_VARS}
    for k in UPDATE_VARS:
        os.environ.pop(k, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def renormalised(data, mode):
    """A routing change: each token's gates renormalised over its kept routes."""
    tokens, capacity = megatron.route(data, mode)
    out = []
    for routes in tokens:
        total = sum(w for _, w, kept in routes if kept)
        out.append([(e, w / total if kept else w, kept) for e, w, kept in routes])
    return out, capacity


def noisy(data, mode):
    """Float noise far below the 4 printed decimals."""
    tokens, capacity = megatron.route(data, mode)
    return [[(e, w * (1 + 3e-7), k) for e, w, k in routes] for routes in tokens], capacity


def fails(router, path, **options):
    """The AssertionError message of a failing check."""
    try:
        assert_routing_snapshot(router, path, **{**OPTIONS, **options})
    except AssertionError as e:
        return str(e)
    raise AssertionError("the check passed")


def test_a_missing_snapshot_is_written_then_checked(tmp_path):
    path = os.path.join(tmp_path, "snapshots", "router.snap")
    with env():
        assert_routing_snapshot(megatron.route, path, **OPTIONS)
        text = open(path).read()
        assert text.startswith("# moe-audit routing snapshot"), text
        assert "source = \"harness\"" in text and "=== inference ===" in text
        assert_routing_snapshot(megatron.route, path, **OPTIONS)
        assert open(path).read() == text
        assert routing_snapshot(megatron.route, **OPTIONS) == text


def test_a_renormalised_weight_fails_with_a_diff(tmp_path):
    path = os.path.join(tmp_path, "router.snap")
    with env():
        assert_routing_snapshot(megatron.route, path, **OPTIONS)
        message = fails(renormalised, path)
    assert "routing changed" in message and "tokens moved" in message, message
    assert " weight " in message and "-> 1.0000" in message, message
    assert "MOE_AUDIT_UPDATE=1" in message


def test_float_noise_below_the_precision_passes(tmp_path):
    path = os.path.join(tmp_path, "router.snap")
    with env():
        assert_routing_snapshot(megatron.route, path, **OPTIONS)
        assert_routing_snapshot(noisy, path, **OPTIONS)


def test_update_variables_rewrite(tmp_path):
    path = os.path.join(tmp_path, "router.snap")
    with env():
        assert_routing_snapshot(megatron.route, path, **OPTIONS)
    for variables in ({"MOE_AUDIT_UPDATE": "1"}, {"INSTA_UPDATE": "always"}):
        with env(**variables):
            assert_routing_snapshot(renormalised, path, **OPTIONS)
        with env():
            assert_routing_snapshot(renormalised, path, **OPTIONS)
            fails(megatron.route, path)
        with env(MOE_AUDIT_UPDATE="1"):
            assert_routing_snapshot(megatron.route, path, **OPTIONS)


def test_ci_and_insta_new_never_overwrite(tmp_path):
    path = os.path.join(tmp_path, "router.snap")
    with env(CI="1"):
        assert "no snapshot" in fails(megatron.route, path)
        assert not os.path.exists(path)
    with env(INSTA_UPDATE="new"):
        fails(megatron.route, path)
        assert os.path.exists(path + ".new") and not os.path.exists(path)
        os.rename(path + ".new", path)
        assert "is " + path + ".new" in fails(renormalised, path)
        assert open(path + ".new").read() != open(path).read()


def test_a_router_object_describes_itself(tmp_path):
    class Router:
        name, experts, top_k = "megatron-probs-py", 8, 2

        def route(self, data, mode):
            return megatron.route(data, mode)

    path = os.path.join(tmp_path, "router.snap")
    with env():
        assert_routing_snapshot(megatron.route, path, **OPTIONS, seq_len=4, seed=3)
        assert_routing_snapshot(Router(), path, seq_len=4, seed=3)
        assert "made differently" in fails(Router(), path, seq_len=5, seed=3)


if __name__ == "__main__":
    failed = 0
    for name, test in sorted(globals().items()):
        if name.startswith("test_"):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    test(tmp)
                    print(f"ok {name}")
                except Exception as e:  # noqa: BLE001
                    failed += 1
                    print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)

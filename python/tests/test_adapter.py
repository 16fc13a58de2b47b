"""The adapter: its protocol codecs byte for byte (docs/PROTOCOL.md), and audits of the numpy
example routers through the installed binary, served from this process. Needs numpy."""

import importlib
import io
import json
import os
import runpy
import struct
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

import moe_audit
from moe_audit._wire import v1, v2
from moe_audit.adapter import columns, serve

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


def example(name):
    """An example router, loaded from its file (it is no module of the package)."""
    return SimpleNamespace(**runpy.run_path(os.path.join(EXAMPLES, f"{name}.py")))


ROUTES = moe_audit.routes_from_arrays([[3, 0], [1, 2]], [[0.75, 0.25], [0.5, 0.5]], [[True, False], [True, True]])


def test_routes_read_as_tuples_and_lists_give_the_same_columns():
    assert ROUTES[0] == [(3, 0.75, True), (0, 0.25, False)] and len(ROUTES) == 2
    listed = [ROUTES[0], [{"expert": 1, "weight": 0.5, "kept": True}, (2, 0.5, True)]]
    for a, b in zip(columns(ROUTES), columns(listed)):
        assert np.array_equal(a, b)


def test_v1_response_line():
    line = v1.response(5, columns(ROUTES), [2] * 4, experts=4)
    assert json.loads(line) == {
        "id": 5,
        "tokens": [[{"expert": 3, "weight": 0.75, "kept": True}, {"expert": 0, "weight": 0.25, "kept": False}],
                   [{"expert": 1, "weight": 0.5, "kept": True}, {"expert": 2, "weight": 0.5, "kept": True}]],
        "capacity": [2, 2, 2, 2],
    }
    # /1 has one capacity per call: a per-call scope is that, a per-sequence one cannot be said.
    assert json.loads(v1.response(5, columns(ROUTES), {"scope": "batch", "slots": [3]}, 4))["capacity"] == [3] * 4
    assert json.loads(v1.response(5, columns(ROUTES), {"scope": "sequence", "slots": [1]}, 4))["capacity"] is None


def test_v2_response_frame_is_the_documented_bytes():
    header, payload = v2.response(7, columns(ROUTES), {"scope": "sequence", "slots": [1, 1]}, experts=4)
    assert json.loads(header) == {"id": 7, "routes": 4, "capacity": {"scope": "sequence", "slots": [1, 1]},
                                  "bytes": 4 * 2 + 9 * 4}
    assert header.endswith(b"\n")
    assert payload == (struct.pack("<2I", 2, 2) + struct.pack("<4i", 3, 0, 1, 2)
                       + struct.pack("<4f", 0.75, 0.25, 0.5, 0.5) + bytes([1, 0, 1, 1]))


def test_v2_request_frames_with_and_without_padding():
    data = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    mask = bytes([0, 0, 1, 0, 1, 1])
    frames = b""
    for i, padding in ((1, False), (2, True)):
        body = data.astype("<f4").tobytes() + (mask if padding else b"")
        head = {"id": i, "mode": "train", "batch": 2, "seq_len": 3, "width": 4, "padding": padding, "seed": 9,
                "bytes": len(body)}
        frames += json.dumps(head).encode() + b"\n" + body
    stream = io.BufferedReader(io.BytesIO(frames))
    first, second = v2.read_request(stream, 4), v2.read_request(stream, 4)
    assert v2.read_request(stream, 4) is None
    assert first.id == 1 and first.seed == 9 and first.padding is None and np.array_equal(first.data, data)
    assert second.padding.tolist() == [[False, False, True], [False, True, True]]
    assert np.array_equal(second.data, data)
    short = io.BufferedReader(io.BytesIO(frames[: len(frames) - 3]))
    v2.read_request(short, 4)
    with pytest.raises(EOFError):
        v2.read_request(short, 4)


def test_serve_passes_seed_and_padding_to_a_route_that_takes_them():
    seen = []

    def route(data, mode, seed=None, padding=None):
        seen.append((mode, seed, None if padding is None else padding.tolist()))
        t = data.shape[0] * data.shape[1]
        return moe_audit.routes_from_arrays(np.zeros((t, 1)), np.ones((t, 1))), None

    body = np.zeros((1, 2, 3), "<f4").tobytes() + bytes([0, 1])
    head = {"id": 1, "mode": "inference", "batch": 1, "seq_len": 2, "width": 3, "padding": True, "seed": 4,
            "bytes": len(body)}
    out = io.BytesIO()
    serve(route, "r", 2, 1, "hidden", 3, stdin=io.BufferedReader(io.BytesIO(json.dumps(head).encode() + b"\n" + body)),
          stdout=out, protocol=v2.PROTOCOL, padding_mask=True)
    hs, rest = out.getvalue().split(b"\n", 1)
    assert json.loads(hs) == {"protocol": "moe-audit/2", "name": "r", "experts": 2, "top_k": 1, "input": "hidden",
                              "hidden_size": 3, "responses": "binary", "padding_mask": True}
    assert seen == [("inference", 4, [[False, True]])]
    assert json.loads(rest.split(b"\n", 1)[0])["bytes"] == 4 * 2 + 9 * 2


def report(proc):
    assert proc.returncode in (0, 1), proc.stderr
    findings = json.loads(proc.stdout)["routers"][0]["findings"]
    return proc.returncode, "".join(f["probe"] for f in findings if f["verdict"] == "leak")


SIZES = ("--format", "json", "--batch", "2", "--seq-len", "32", "--trials", "8")


def test_check_audits_a_router_of_this_process():
    mixtral = example("mixtral_router")
    assert report(moe_audit.check(mixtral.route, *SIZES, name="mixtral-py", experts=8, top_k=2, input="hidden",
                                  hidden_size=32)) == (0, "")
    megatron = example("megatron_probs_router")
    assert report(moe_audit.check(megatron.route, *SIZES, experts=8, top_k=2)) == (1, "PFNRL")


def test_check_raises_the_routers_own_error():
    def broken(data, mode):
        raise ValueError("the router broke")

    with pytest.raises(ValueError, match="the router broke"):
        moe_audit.check(broken, *SIZES, experts=8, top_k=2)


def test_check_returns_moe_audits_usage_error():
    proc = moe_audit.check(example("mixtral_router").route, "--batch", "0", experts=8, top_k=2)
    assert proc.returncode == 2 and proc.stderr.startswith("error:"), proc.stderr


def test_routes_may_leave_tokens_without_routes():
    routes = moe_audit.routes_from_arrays([[3, 0], [1, 2]], [[0.75, 0.25], [0.5, 0.5]], present=[[True], [False]])
    assert routes[1] == [] and len(routes) == 2
    count, expert, weight, kept = routes.columns()
    assert count.tolist() == [2, 0] and expert.tolist() == [3, 0] and weight.tolist() == [0.75, 0.25]
    line = json.loads(v1.response(1, routes.columns(), None, 4))
    assert line["tokens"][1] == []


def test_trace_answers_keep_a_scoped_capacity_over_v2_only(tmp_path):
    from moe_audit.adapter import answer_plan

    manifest = {"router": {"experts": 4}, "calls": [{"id": 1, "mode": "train", "tensor": "t0"}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    header = json.dumps({"t0": {"dtype": "F32", "shape": [1, 2, 4], "data_offsets": [0, 32]}}).encode()
    (tmp_path / "inputs.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(32))

    def route(data, mode):
        return moe_audit.routes_from_arrays([[0], [1]], [[1.0], [1.0]]), {"scope": "sequence", "slots": [1]}

    for protocol, capacity in ((1, None), (2, {"scope": "sequence", "slots": [1]})):
        answer_plan(route, str(tmp_path), protocol)
        assert json.loads((tmp_path / "decisions.jsonl").read_text())["capacity"] == capacity


def test_the_old_moe_audit_router_module_is_a_deprecated_alias_speaking_v1():
    # Adapters written for the single-file `moe_audit_router` (before the package) import it still,
    # with a warning naming the replacement, and speak the /1 protocol it spoke.
    import importlib
    import sys

    sys.modules.pop("moe_audit_router", None)
    with pytest.warns(DeprecationWarning, match="import from moe_audit instead"):
        old = importlib.import_module("moe_audit_router")
    assert old.PROTOCOL == v1.PROTOCOL and old.routes_from_arrays is moe_audit.routes_from_arrays

    def route(data, mode):
        t = data.shape[0] * data.shape[1]
        return old.routes_from_arrays(np.ones((t, 1)), np.ones((t, 1))), None

    request = {"id": 7, "mode": "train", "batch": 1, "seq_len": 2, "data": [[[0.0, 1.0], [1.0, 0.0]]]}
    out = io.BytesIO()
    old.serve(route, "old", 2, 1, stdin=io.BufferedReader(io.BytesIO(json.dumps(request).encode() + b"\n")),
              stdout=out)
    hs, response = out.getvalue().decode().splitlines()
    assert json.loads(hs)["protocol"] == "moe-audit/1"
    assert json.loads(response)["id"] == 7 and json.loads(response)["tokens"][1][0]["expert"] == 1


def safetensors(path, tensors):
    """Writes tensors given as name -> (dtype, shape, raw bytes) as a safetensors file."""
    header, body = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


def test_safetensors_are_read_as_float32_from_bf16_f16_f32_and_f64(tmp_path):
    values = np.array([[1.0, -2.5], [0.15625, 3.0e38]], dtype=np.float32)
    # bf16 is the upper half of a float32: these values have exact bf16 forms.
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    path = tmp_path / "t.safetensors"
    safetensors(path, {
        "b": ("BF16", [2, 2], bf16),
        "h": ("F16", [4], values[:1].astype("<f2").tobytes() + np.array([0.5, 1], "<f2").tobytes()),
        "f": ("F32", [2, 2], values.astype("<f4").tobytes()),
        "d": ("F64", [1, 2], values[0].astype("<f8").tobytes()),
    })
    t = moe_audit.read_safetensors(path)
    assert all(a.dtype == np.float32 for a in t.values())
    assert t["b"].tolist() == [[1.0, -2.5], [0.15625, float(bf16_round(3.0e38))]]
    assert t["h"].tolist() == [1.0, -2.5, 0.5, 1.0]
    assert t["f"].tolist() == values.tolist() and t["d"].tolist() == [[1.0, -2.5]]


def bf16_round(x):
    """x truncated to bf16 (the test writes bf16 by truncation)."""
    return (np.array([x], np.float32).view(np.uint32) >> 16 << 16).view(np.float32)[0]


def test_bad_safetensors_say_what_is_wrong(tmp_path):
    path = tmp_path / "t.safetensors"
    safetensors(path, {"q": ("I8", [2], b"\x01\x02")})
    with pytest.raises(ValueError, match="tensor q has dtype I8"):
        moe_audit.read_safetensors(path)
    text = json.dumps({"f": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
    with pytest.raises(ValueError, match="past the file"):
        moe_audit.read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="does not fit"):
        moe_audit.read_safetensors(path)


def test_the_old_codec_modules_warn_and_name_the_replacement():
    for v in ("v1", "v2"):
        sys.modules.pop(f"moe_audit.{v}", None)
        with pytest.warns(DeprecationWarning, match=f"moe_audit._wire.{v}.*protocol="):
            old = importlib.import_module(f"moe_audit.{v}")
        assert old.PROTOCOL == f"moe-audit/{v[1]}" and old.response is getattr(moe_audit._wire, v).response
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(moe_audit.adapter)  # the package itself uses the private codecs


def test_run_parses_its_arguments(tmp_path, capsys):
    route = example("mixtral_router").route
    with pytest.raises(SystemExit) as e:
        moe_audit.run(route, "r", 8, 2, argv=["--answer-plan"])
    assert e.value.code == 2 and "--answer-plan: expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        moe_audit.run(route, "r", 8, 2, argv=["--help"])
    assert e.value.code == 0 and "--answer-plan DIR" in capsys.readouterr().out


def test_a_failing_router_leaves_no_answers(tmp_path):
    manifest = {"router": {"experts": 4}, "calls": [{"id": 1, "mode": "train", "tensor": "t0"}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    safetensors(tmp_path / "inputs.safetensors", {"t0": ("F32", [1, 2, 4], bytes(32))})

    def route(data, mode):
        print("to stderr, not the answers")
        raise RuntimeError("the router failed")

    with pytest.raises(RuntimeError, match="the router failed"):
        moe_audit.answer_plan(route, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["inputs.safetensors", "manifest.json"]

"""The adapter: its protocol codecs byte for byte (docs/PROTOCOL.md), and audits of the numpy
example routers through the installed binary, served from this process. Needs numpy."""

import importlib
import io
import json
import os
import re
import runpy
import struct
import subprocess
import sys
import warnings
from types import SimpleNamespace
from typing import Any

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
    listed: list[Any] = [ROUTES[0], [{"expert": 1, "weight": 0.5, "kept": True}, (2, 0.5, True)]]
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
    assert first is not None and second is not None and second.padding is not None
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


def report(found):
    return found.exit_code, "".join(found.leaks)


SIZES: dict[str, Any] = dict(batch=2, seq_len=32, trials=8)


def test_check_audits_a_router_of_this_process():
    mixtral = example("mixtral_router")
    assert report(moe_audit.check(mixtral.route, **SIZES, name="mixtral-py", experts=8, top_k=2, input="hidden",
                                  hidden_size=32)) == (0, "")
    megatron = example("megatron_probs_router")
    assert report(moe_audit.check(megatron.route, **SIZES, experts=8, top_k=2)) == (1, "PFNRL")


def test_check_raises_the_routers_own_error():
    def broken(data, mode):
        raise ValueError("the router broke")

    with pytest.raises(ValueError, match="the router broke"):
        moe_audit.check(broken, **SIZES, experts=8, top_k=2)


def test_check_raises_moe_audits_usage_error():
    with pytest.raises(moe_audit.CheckError) as e:
        moe_audit.check(example("mixtral_router").route, batch=0, experts=8, top_k=2)
    assert e.value.exit_code == 2 and e.value.stderr.startswith("error:"), e.value.stderr


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


def safetensors(path, tensors):
    """Writes tensors given as name -> (dtype, shape, raw bytes) as a safetensors file."""
    header, body = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


@pytest.fixture(params=["library", "numpy"])
def reader(request, monkeypatch):
    """read_safetensors by the safetensors library (installed under CI: transformers needs it),
    or by numpy alone (the library made unimportable)."""
    if request.param == "library":
        pytest.importorskip("safetensors")
    else:
        monkeypatch.setitem(sys.modules, "safetensors", None)
    return moe_audit.read_safetensors


def test_safetensors_are_read_as_float32_from_bf16_f16_f32_and_f64(tmp_path, reader):
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
    t = reader(path)
    assert all(a.dtype == np.float32 for a in t.values())
    assert t["b"].tolist() == [[1.0, -2.5], [0.15625, float(bf16_round(3.0e38))]]
    assert t["h"].tolist() == [1.0, -2.5, 0.5, 1.0]
    assert t["f"].tolist() == values.tolist() and t["d"].tolist() == [[1.0, -2.5]]


def test_the_library_and_numpy_read_the_same_arrays_as_torch(tmp_path, monkeypatch):
    # Written by the library itself (its header order, alignment and metadata), read back both
    # ways, against torch's reading of the same file (BF16 widened exactly to float32).
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    tensors = {f"{dtype}/{n}": (torch.randn(3, 5, generator=g) * 100).to(getattr(torch, dtype))
               for dtype in ("bfloat16", "float16", "float32", "float64") for n in range(2)}
    for with_bf16 in (True, False):
        path = tmp_path / f"t{with_bf16}.safetensors"
        chosen = {k: v for k, v in tensors.items() if with_bf16 or not k.startswith("bfloat16")}
        safetensors_torch.save_file(chosen, path, metadata={"format": "pt"})
        expected = {k: v.float().numpy() for k, v in safetensors_torch.load_file(path).items()}
        by_library = moe_audit.read_safetensors(path)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "safetensors", None)
            by_numpy = moe_audit.read_safetensors(path)
        for found in (by_library, by_numpy):
            assert sorted(found) == sorted(expected)
            for k, a in found.items():
                assert a.dtype == np.float32 and a.shape == expected[k].shape, k
                assert a.tobytes() == expected[k].tobytes(), k


def bf16_round(x):
    """x truncated to bf16 (the test writes bf16 by truncation)."""
    return (np.array([x], np.float32).view(np.uint32) >> 16 << 16).view(np.float32)[0]


def test_bad_safetensors_say_what_is_wrong(tmp_path, reader):
    path = tmp_path / "t.safetensors"
    safetensors(path, {"q": ("I8", [2], b"\x01\x02")})
    with pytest.raises(ValueError, match="tensor q has dtype I8"):
        reader(path)
    for dtype in ("F32", "BF16"):
        # Bytes past the end of the file.
        text = json.dumps({"f": {"dtype": dtype, "shape": [4], "data_offsets": [0, 16]}}).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(8))
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: "):
            reader(path)
    # As many bytes as the file holds, but not as many as the shape needs.
    safetensors(path, {"f": ("F32", [2, 2], bytes(12))})
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: "):
        reader(path)
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: "):
        reader(path)


def test_numpy_alone_names_the_tensor_whose_bytes_do_not_fit_its_shape(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    path = tmp_path / "t.safetensors"
    safetensors(path, {"f": ("F32", [2, 2], bytes(12))})
    with pytest.raises(ValueError, match=r"tensor f of shape \[2, 2\] and dtype F32 has 12 bytes, not 16$"):
        moe_audit.read_safetensors(path)
    with pytest.raises(ValueError, match="past the file"):
        safetensors(path, {"f": ("F32", [4], bytes(16))})
        path.write_bytes(path.read_bytes()[:-8])
        moe_audit.read_safetensors(path)
    path.write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(ValueError, match="does not fit"):
        moe_audit.read_safetensors(path)


def test_the_package_imports_without_a_warning():
    # The codecs are private (moe_audit._wire); 0.1.0's public aliases were never released.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(moe_audit.adapter)
    for v in ("v1", "v2"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"moe_audit.{v}")


def test_run_parses_its_arguments(tmp_path, capsys):
    route = example("mixtral_router").route
    with pytest.raises(SystemExit) as e:
        moe_audit.run(route, "r", 8, 2, argv=["--answer-plan"])
    assert e.value.code == 2 and "--answer-plan: expected one argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        moe_audit.run(route, "r", 8, 2, argv=["--help"])
    assert e.value.code == 0 and "--answer-plan DIR" in capsys.readouterr().out


def test_run_leaves_the_scripts_own_arguments_alone(tmp_path):
    # An adapter script with options of its own (issue 37): run() read sys.argv and failed on
    # them. It reads only --answer-plan DIR there; the script parses the rest.
    script = tmp_path / "router.py"
    script.write_text(
        "import argparse, sys\n"
        "import numpy as np\n"
        "from moe_audit import routes_from_arrays, run\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--layer', type=int, required=True)\n"
        "p.add_argument('-v', action='store_true')\n"
        "args, _ = p.parse_known_args()\n"
        "print('layer', args.layer, args.v, file=sys.stderr)\n"
        "def route(data, mode):\n"
        "    t = data.shape[0] * data.shape[1]\n"
        "    return routes_from_arrays(np.tile([args.layer, 1], (t, 1)), np.full((t, 2), 0.5)), 2\n"
        "run(route, name='r', experts=8, top_k=2)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(moe_audit.__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script), "--layer", "3", "-v"], input=frame(2, 1),
                          capture_output=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    hs, responses = answers(2, proc.stdout)
    assert hs["name"] == "r" and [r["id"] for r in responses] == [1]
    assert proc.stderr.decode() == "layer 3 True\n"
    # --answer-plan DIR among the script's own options still answers the plan.
    route = example("mixtral_router").route
    argv = ["script", "--layer", "3", "--answer-plan=" + str(tmp_path / "missing"), "-v"]
    with pytest.raises(FileNotFoundError, match="missing/manifest.json"):
        old, sys.argv = sys.argv, argv
        try:
            moe_audit.run(route, "r", 8, 2)
        finally:
            sys.argv = old


def test_only_an_adapter_offering_seed_calls_declares_it():
    # moe-audit's advice for a random router names seed_calls=True only where the adapter in
    # use offers it (issue 37): the handshake says so, a route function's does not.
    route, spec = moe_audit.adapter.describe(two_routes, {"experts": 8})
    assert spec["seed_calls"] is None
    assert "seed_calls" not in moe_audit.adapter.handshake("r", 8, 2, "logits", None, seed_calls=None)
    offered = SimpleNamespace(route=two_routes, experts=8, seed_calls=False)
    route, spec = moe_audit.adapter.describe(offered, {})
    assert spec["seed_calls"] is False
    hs = moe_audit.adapter.handshake(**spec)
    assert hs["seed_calls"] is False and hs["protocol"] == "moe-audit/2"
    assert "seed_calls" not in moe_audit.adapter.handshake(**dict(spec, protocol=1)), "/1 has no seed"


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


# Issue 30: the adapter's first mistakes. The helpers serve a router in-process over byte streams.

E8 = 8  # experts in these tests: ids 0 to 7


def frame(protocol, i, batch=2, seq_len=4, width=E8):
    """One request of zeros, as moe-audit writes it in that protocol."""
    data = np.zeros((batch, seq_len, width), np.float32)
    if protocol == 1:
        req = {"id": i, "mode": "train", "batch": batch, "seq_len": seq_len, "data": data.tolist()}
        return json.dumps(req).encode() + b"\n"
    body = data.astype("<f4").tobytes()
    head = {"id": i, "mode": "train", "batch": batch, "seq_len": seq_len, "width": width, "padding": False,
            "seed": 0, "bytes": len(body)}
    return json.dumps(head).encode() + b"\n" + body


def answers(protocol, raw):
    """(handshake, response lines or headers) of a router's stdout: anything else fails to parse."""
    hs, rest = raw.split(b"\n", 1)
    out = []
    while rest:
        line, rest = rest.split(b"\n", 1)
        out.append(json.loads(line))
        if protocol == 2:
            rest = rest[out[-1]["bytes"]:]
    return json.loads(hs), out


def served(route, protocol, calls=1, **sizes):
    inp = io.BufferedReader(io.BytesIO(b"".join(frame(protocol, i + 1, **sizes) for i in range(calls))))
    out = io.BytesIO()
    serve(route, "r", E8, 2, stdin=inp, stdout=out, protocol=protocol)
    return answers(protocol, out.getvalue())


def two_routes(data, mode):
    t = data.shape[0] * data.shape[1]
    return moe_audit.routes_from_arrays(np.tile([0, 1], (t, 1)), np.full((t, 2), 0.5))


@pytest.mark.parametrize("protocol", [1, 2])
@pytest.mark.parametrize("capacity", [3, np.int64(3), np.array(3)])
def test_an_int_capacity_is_the_same_slots_for_every_expert(protocol, capacity):
    _, (response,) = served(lambda data, mode: (two_routes(data, mode), capacity), protocol)
    assert response["capacity"] == [3] * E8
    codec = v1 if protocol == 1 else v2
    encoded = codec.response(1, columns(ROUTES), capacity, experts=4)
    assert json.loads(encoded if protocol == 1 else encoded[0])["capacity"] == [3] * 4


def test_an_int_capacity_in_trace_answers(tmp_path):
    manifest = {"router": {"experts": 4}, "calls": [{"id": 1, "mode": "train", "tensor": "t0"}]}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    safetensors(tmp_path / "inputs.safetensors", {"t0": ("F32", [1, 2, 4], bytes(32))})

    def route(data, mode):
        return moe_audit.routes_from_arrays([[0], [1]], [[1.0], [1.0]]), 0

    for protocol in (1, 2):
        moe_audit.answer_plan(route, str(tmp_path), protocol)
        assert json.loads((tmp_path / "decisions.jsonl").read_text())["capacity"] == [0] * 4


FORMS = ('a capacity is None (dropless), an int (the same slots for every expert), one int per expert (4 of them), '
         'or {"scope": "sequence"|"batch"|"tokens:N", "slots": [...]}')


@pytest.mark.parametrize("capacity, error, problem", [
    (2.5, TypeError, "capacity 2.5: a float is not a capacity"),
    (4.0, TypeError, "capacity 4.0: a float is not a capacity"),  # rounding is the router's choice
    ("4", TypeError, "capacity '4': a str is not a capacity"),
    (True, TypeError, "capacity True: a bool is not a capacity"),
    ([2, 2, 2], ValueError, "capacity [2, 2, 2]: 3 slot counts, not one per expert (4)"),
    (np.ones((2, 4), int), TypeError, "a 2-D array is not a capacity"),
    ([2, 2.5, 2, 2], TypeError, "slot count 1 is 2.5, not an int"),
    (-1, ValueError, "capacity -1: a negative count"),
    ([2, -1, 2, 2], ValueError, "slot count 1 is -1, a negative count"),
    ({"slots": [2]}, ValueError, "no 'scope' key"),
    ({"scope": "batch"}, ValueError, "no 'slots' key"),
    ({"scope": "sequence", "slots": [2], "slot": 2}, ValueError, "unknown key 'slot'"),
    ({"scope": "seq", "slots": [2]}, ValueError, "scope 'seq' is not 'sequence', 'batch' or 'tokens:N' (N >= 1)"),
    ({"scope": "tokens:0", "slots": [2]}, ValueError, "scope 'tokens:0' is not"),
    ({"scope": "batch", "slots": 2}, TypeError, "slots 2 is not a list of ints"),
])
def test_a_capacity_of_another_form_names_the_accepted_forms(capacity, error, problem):
    for encode in (v1.response, v2.response):
        with pytest.raises(error) as e:
            encode(1, columns(ROUTES), capacity, experts=4)
        message = str(e.value)
        assert message.startswith("moe-audit adapter: route() returned capacity ") and "\n" not in message
        assert problem in message and message.endswith(FORMS), message


def test_a_scoped_capacity_needs_one_count_per_group():
    def route(data, mode):
        return two_routes(data, mode), {"scope": "sequence", "slots": [2]}

    with pytest.raises(ValueError, match=r"scope 'sequence' makes 2 group\(s\) of batch 2 \* seq_len 4, so slots "
                                         r"needs 2 counts, not 1"):
        served(route, 2)
    _, (ok,) = served(lambda data, mode: (two_routes(data, mode), {"scope": "tokens:3", "slots": [1, 1, 1]}), 2)
    assert ok["capacity"] == {"scope": "tokens:3", "slots": [1, 1, 1]}


def listed(bad_route):
    """A route answering lists of routes, with token 5 (batch 1, position 1)'s second route replaced."""
    def route(data, mode):
        tokens = [[(0, 0.5, True), (1, 0.5, False)] for _ in range(data.shape[0] * data.shape[1])]
        tokens[5][1] = bad_route
        return tokens
    return route


def arrays(field, value):
    """A route answering [T, k] arrays, with token 5's second route's field set to value."""
    def route(data, mode):
        t = data.shape[0] * data.shape[1]
        a = {"experts": np.tile([0, 1], (t, 1)), "weights": np.full((t, 2), 0.5), "kept": np.ones((t, 2), bool)}
        a[field][5, 1] = value
        return moe_audit.routes_from_arrays(a["experts"], a["weights"], a["kept"])
    return route


TOKEN5 = "moe-audit adapter: route() returned token 5 (batch 1, position 1), "
AT = TOKEN5 + "route 1: "


@pytest.mark.parametrize("route, error, problem", [
    (listed((8, 0.5, True)), ValueError, "expert 8 is out of range 0 to 7"),
    (listed((-1, 0.5, True)), ValueError, "expert -1 is out of range 0 to 7"),
    (listed((1.5, 0.5, True)), TypeError, "expert 1.5 is not an integer"),
    (listed(("1", 0.5, True)), TypeError, "expert '1' is not an integer"),
    (listed((0, 0.5, True)), ValueError, "expert 0 appears twice (routes 0 and 1)"),
    (listed((1, float("nan"), True)), ValueError, "weight nan is not a finite number"),
    (listed((1, "0.5", True)), ValueError, "weight '0.5' is not a finite number"),
    (listed((1, 0.5, "yes")), TypeError, "kept 'yes' is not a bool (True/False or 1/0)"),
    (listed((1, 0.5)), TypeError, "(1, 0.5) is not (expert, weight, kept) or a dict with those keys"),
    (listed({"expert": 1, "weight": 0.5}), TypeError, "is not (expert, weight, kept) or a dict with those keys"),
    (arrays("experts", 8), ValueError, "expert 8 is out of range 0 to 7"),
    (arrays("experts", 0), ValueError, "expert 0 appears twice (routes 0 and 1)"),
    (arrays("weights", np.inf), ValueError, "weight inf is not a finite number"),
])
@pytest.mark.parametrize("protocol", [1, 2])
def test_a_bad_route_is_named_by_token_position_and_field(route, error, problem, protocol):
    with pytest.raises(error) as e:
        served(route, protocol)
    assert str(e.value).startswith(AT) and problem in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and ".." not in str(e.value)


def test_routes_absent_from_a_token_are_not_checked():
    def route(data, mode):
        t = data.shape[0] * data.shape[1]
        experts = np.tile([0, -1], (t, 1))  # -1: no second route (as moe_audit.hf writes padding)
        weights = np.tile([1.0, np.nan], (t, 1))
        return moe_audit.routes_from_arrays(experts, weights, present=experts >= 0), 2

    _, (response,) = served(route, 1)
    assert response["tokens"][0] == [{"expert": 0, "weight": 1.0, "kept": True}]

    def route_past_a_gap(data, mode):
        experts = np.tile([0, 1, 2], (8, 1))
        experts[5, 2] = 8
        present = np.ones((8, 3), bool)
        present[5, 0] = False  # the bad route is the second sent, the array's column 2
        return moe_audit.routes_from_arrays(experts, np.ones((8, 3)), present=present)

    with pytest.raises(ValueError, match=r"^" + re.escape(TOKEN5 + "route 2: expert 8 is out of range 0 to 7") + "$"):
        served(route_past_a_gap, 2)


@pytest.mark.parametrize("route, error, message", [
    (lambda data, mode: two_routes(data[:, :3], mode), ValueError,
     "route() returned 6 tokens, expected batch * seq_len = 2 * 4 = 8 (sequence-major: token b * seq_len + s)"),
    (lambda data, mode: listed((1, 0.5, True))(data, mode)[:7], ValueError, "route() returned 7 tokens, expected"),
    (lambda data, mode: np.zeros((8, 2), int), TypeError,
     "route() returned routes of type ndarray; expected routes_from_arrays(experts, weights, kept)"),
    (lambda data, mode: (two_routes(data, mode), None, "extra"), TypeError,
     "route() returned a tuple of 3 items; expected the routes, or (routes, capacity)"),
    (lambda data, mode: [[(0, 0.5, True)]] * 5 + [3] + [[]] * 2, TypeError,
     "route() returned token 5 (batch 1, position 1) as 3; a token is a list of (expert, weight, kept) routes"),
])
def test_a_bad_answer_as_a_whole_is_named(route, error, message):
    with pytest.raises(error) as e:
        served(route, 2)
    assert str(e.value).startswith("moe-audit adapter: " + message), str(e.value)


def test_routes_whose_shapes_differ_are_named():
    def route(data, mode):
        routes = two_routes(data, mode)
        routes.weights = routes.weights[:, :1]  # changed after it was built
        return routes

    with pytest.raises(ValueError, match=r"route\(\) returned Routes whose arrays differ in shape \(experts \(8, 2\), "
                                         r"weights \(8, 1\), kept \(8, 2\)\); each must be \[tokens, k\]"):
        served(route, 2)


@pytest.mark.parametrize("args, error, message", [
    (([[0, 1.5]], [[0.5, 0.5]]), ValueError, "experts[0, 1] is 1.5, not an expert id (an integer)"),
    (([[0, 1]], [[0.5, 0.5]], [[1, 2]]), ValueError, "kept[0, 1] is 2, not a bool (True/False or 1/0)"),
    (([[0, 1]], [[0.5, 0.5]], [["y", "n"]]), TypeError, "kept must be bools, got a <U1 array"),
    (([[0, 1]], [["a", "b"]]), TypeError, "weights must be numbers, got a <U1 array"),
    (([[0, 1]], [[0.5]]), ValueError, "experts, weights and kept must be [tokens, k] arrays of one shape"),
    (([[0, 1]], [[0.5, 0.5]], None, [[True], [False]]), ValueError,
     "present has shape (2, 1), which does not broadcast to the routes' (1, 2)"),
])
def test_routes_from_arrays_refuses_what_it_would_have_to_guess(args, error, message):
    with pytest.raises(error) as e:
        moe_audit.routes_from_arrays(*args)
    assert str(e.value).startswith("moe-audit adapter: routes_from_arrays(): " + message), str(e.value)
    # Whole floats are ids (np.zeros makes them), 0/1 are flags.
    routes = moe_audit.routes_from_arrays(np.ones((1, 2)) * [[0, 1]], [[0.5, 0.5]], [[1, 0]])
    assert routes[0] == [(0, 0.5, True), (1, 0.5, False)]


class Chatty(io.RawIOBase):
    """stdin that prints once before its first bytes, as a thread of the router printing while
    serve waits for moe-audit's first request."""

    def __init__(self, data):
        self.data = io.BytesIO(data)
        self.said = False

    def readable(self):
        return True

    def readinto(self, b):
        if not self.said:
            self.said = True
            print("still warming up")
        return self.data.readinto(b)


@pytest.mark.parametrize("protocol", [1, 2])
def test_print_never_reaches_the_protocol_stream(protocol, monkeypatch):
    stdout, stderr = io.BytesIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(stdout, write_through=False))
    monkeypatch.setattr(sys, "stderr", stderr)
    frames = frame(protocol, 1) + frame(protocol, 2)
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(buffer=io.BufferedReader(Chatty(frames))))

    def route(data, mode):
        print("routing", data.shape)
        return two_routes(data, mode), 2

    print("loading my model...")  # at import time, before run(): it goes out ahead of the handshake
    serve(route, "r", E8, 2, protocol=protocol)
    sys.stdout.flush()
    raw = stdout.getvalue()
    assert raw.startswith(b"loading my model...\n")
    hs, responses = answers(protocol, raw[len(b"loading my model...\n"):])
    assert hs["name"] == "r" and [r["id"] for r in responses] == [1, 2]
    assert stderr.getvalue() == "still warming up\nrouting (2, 4, 8)\nrouting (2, 4, 8)\n"


def test_a_router_process_exits_with_the_message_as_its_last_line_of_stderr(tmp_path):
    # moe-audit quotes the router's last line of stderr: the traceback must end with the message.
    script = tmp_path / "router.py"
    script.write_text(
        "import numpy as np\n"
        "from moe_audit import routes_from_arrays, run\n"
        "def route(data, mode):\n"
        "    t = data.shape[0] * data.shape[1]\n"
        "    experts = np.tile([0, 1], (t, 1))\n"
        "    experts[5, 1] = 8\n"
        "    return routes_from_arrays(experts, np.full((t, 2), 0.5)), 2\n"
        "run(route, name='r', experts=8, top_k=2)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(moe_audit.__file__)),
                                                      os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], input=frame(2, 1), capture_output=True, env=env,
                          timeout=60)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["protocol"] == "moe-audit/2"  # the handshake alone: no partial answer
    assert proc.stderr.decode().splitlines()[-1] == "ValueError: " + AT + "expert 8 is out of range 0 to 7"

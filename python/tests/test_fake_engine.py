"""The fake serving engine of the ``moe-audit engine`` integration tests (tests/it/engines/fake_engine.py),
tested itself: the payloads of both engines, the prefix cache's accounting, and that each fault changes
the axis it names and no other, at near-ties only. A started server is stopped with SIGTERM and must exit 0.
"""

from __future__ import annotations

import base64
import http.client
import importlib.util
import io
import itertools
import json
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

FAKE = Path(__file__).resolve().parents[2] / "tests" / "it" / "engines" / "fake_engine.py"
_spec = importlib.util.spec_from_file_location("fake_engine", FAKE)
assert _spec is not None and _spec.loader is not None
fake = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fake  # its dataclass looks its module up there
_spec.loader.exec_module(fake)

LAYERS, TOP_K = 4, 2
_salts = itertools.count()


def salt() -> str:
    return f"s{next(_salts)}"


class Server:
    def __init__(self, engine: str, url: str) -> None:
        self.engine, self.url = engine, url

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def generate(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None,
                 **extra: Any) -> tuple[list[int], np.ndarray | None, int, dict[str, Any]]:
        """(output ids, rows [n, L, K] or None, cached tokens, the whole response) of one request."""
        if self.engine == "vllm":
            body = {"model": "fake/toy-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True, **extra}
            if cache_salt is not None:
                body["cache_salt"] = cache_salt
            status, r = self.call("/v1/completions", body)
            assert status == 200, r
            choice = r["choices"][0]
            rows = None
            if choice["routed_experts"] is not None:
                rows = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
            details = r["usage"]["prompt_tokens_details"]
            return choice["token_ids"], rows, details["cached_tokens"] if details else -1, r
        body = {"input_ids": prompt, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}, **extra}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        status, r = self.call("/generate", body)
        assert status == 200, r
        meta = r["meta_info"]
        rows = None
        if "routed_experts" in meta:
            rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS, TOP_K)
        return r["output_ids"], rows, meta["cached_tokens"], r

    def rows(self, prompt: list[int], max_tokens: int, cache_salt: str | None = None, **extra: Any) -> np.ndarray:
        rows = self.generate(prompt, max_tokens, cache_salt, **extra)[1]
        assert rows is not None
        return rows


@contextmanager
def serve(engine: str, *flags: str) -> Iterator[Server]:
    args = [sys.executable, str(FAKE), "--engine", engine, "--port", "0", *flags]
    if engine == "vllm":
        args.append("--enable-prompt-tokens-details")
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("READY "), (line, process.stderr.read() if process.stderr else "")
        yield Server(engine, f"http://127.0.0.1:{int(line.split()[1])}")
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def expected(prompt: list[int], max_tokens: int, seed: int = 0) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The clean model's output ids, rows and margins, computed here without the server."""
    model = fake.ToyMoE(seed, LAYERS, 8, TOP_K, 256)
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model.next_token(model.prefix_hashes(tokens)[-1]))
    hashes = model.prefix_hashes(tokens[:-1])
    return tokens[len(prompt):], model.route(hashes), model.margins(hashes)


def prompt_of(length: int, start: int = 0) -> list[int]:
    return [(7 * i + 3 * start + 1) % 256 for i in range(length)]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_payload_shapes_and_the_clean_model(engine: str) -> None:
    with serve(engine) as s:
        prompt = prompt_of(20)
        ids, rows, cached, r = s.generate(prompt, 5, salt())
        want_ids, want_rows, _ = expected(prompt, 5)
        assert ids == want_ids and cached == 0
        assert rows is not None and rows.shape == (20 + 5 - 1, LAYERS, TOP_K)
        assert rows.dtype == (np.uint8 if engine == "vllm" else np.int32)
        assert (rows == want_rows).all()
        if engine == "vllm":
            assert s.call("/version") == (200, {"version": "0.33.0"})
            assert s.call("/server_info") == (404, {"detail": "Not Found"})
            status, models = s.call("/v1/models")
            assert status == 200 and models["data"][0]["id"] == "fake/toy-moe"
            assert models["data"][0]["max_model_len"] == 2048
            choice = r["choices"][0]
            assert r["object"] == "text_completion" and choice["prompt_token_ids"] == prompt
            assert choice["finish_reason"] == "length"
            assert r["usage"]["prompt_tokens"] == 20 and r["usage"]["completion_tokens"] == 5
            assert r["usage"]["total_tokens"] == 25
            # routed_experts_prompt_start drops the first rows (vllm completion/protocol.py:191-195).
            assert np.array_equal(s.rows(prompt, 5, salt(), routed_experts_prompt_start=7), want_rows[7:])
        else:
            assert s.call("/version") == (404, {"detail": "Not Found"})
            status, info = s.call("/server_info")
            assert status == 200 and info["version"] == "0.5.23"
            assert info["enable_return_routed_experts"] is True and info["disable_radix_cache"] is False
            assert (info["page_size"], info["tp_size"], info["ep_size"]) == (1, 1, 1)
            assert info["chunked_prefill_size"] == 8192 and info["model_path"] == "fake/toy-moe"
            meta = r["meta_info"]
            assert meta["prompt_tokens"] == 20 and meta["completion_tokens"] == 5
            assert meta["finish_reason"] == {"type": "length", "length": 5}
            assert np.array_equal(s.rows(prompt, 5, salt(), routed_experts_start_len=7), want_rows[7:])
            # Without the request's flag, no routes.
            assert "routed_experts" not in s.generate(prompt, 5, salt(), return_routed_experts=False)[3]["meta_info"]


def test_a_seed_changes_the_model() -> None:
    with serve("vllm", "--seed", "1") as s:
        _, rows, _, _ = s.generate(prompt_of(20), 5, salt())
        assert rows is not None and (rows != expected(prompt_of(20), 5)[1]).any()
        assert (rows == expected(prompt_of(20), 5, seed=1)[1]).all()


def test_vllm_cache_counts_whole_blocks_below_the_last_prompt_token() -> None:
    with serve("vllm") as s:
        prompt = prompt_of(40)
        _, first, cached, _ = s.generate(prompt, 8, "a")
        assert cached == 0 and first is not None
        _, hit, cached, _ = s.generate(prompt, 8, "a")
        assert cached == 32 and hit is not None and np.array_equal(hit, first)  # stored rows
        assert s.generate(prompt, 8, "b")[2] == 0  # another salt, another cache
        assert s.generate(prompt[:32], 1, "a")[2] == 16  # at most P - 1 = 31 tokens: one block
        assert s.generate(prompt[:33], 1, "a")[2] == 32
        # The decoded tokens are cached too: 40 + 30 - 1 = 69 forwarded tokens fill four whole blocks.
        ids = s.generate(prompt, 30, "c")[0]
        assert s.generate(prompt + ids, 1, "c")[2] == 64
        status, error = s.call("/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": ""})
        assert status == 400 and error["error"]["param"] == "cache_salt"


def test_sglang_cache_counts_tokens_and_can_be_disabled() -> None:
    with serve("sglang") as s:
        prompt = prompt_of(20)
        first = s.rows(prompt, 4, "a")
        _, hit, cached, _ = s.generate(prompt, 4, "a")
        assert cached == 19 and hit is not None and np.array_equal(hit, first)
        ids = s.generate(prompt, 4, "a")[0]
        assert s.generate(prompt + ids, 1, "a")[2] == 23  # the prompt and the three forwarded decoded tokens
        assert s.generate(prompt, 4, "b")[2] == 0
        assert s.generate(prompt, 4, None, extra_key="k")[2] == 0  # extra_key splits the cache too
    with serve("sglang", "--disable-radix-cache") as s:
        s.generate(prompt, 4, "a")
        assert s.generate(prompt, 4, "a")[2] == 0
        assert s.call("/server_info")[1]["disable_radix_cache"] is True


def test_errors_as_the_engines_answer() -> None:
    with serve("vllm", "--max-model-len", "64") as s:
        status, e = s.call("/v1/completions", {"prompt": [1, 256], "max_tokens": 1})
        assert (status, e["error"]["message"], e["error"]["type"]) == (400, "Token id 256 is out of vocabulary",
                                                                       "BadRequestError")
        status, e = s.call("/v1/completions", {"prompt": [1] * 70, "max_tokens": 1})
        assert status == 400 and "maximum context length is 64 tokens" in e["error"]["message"]
        status, e = s.call("/v1/completions", {"prompt": [1] * 64, "max_tokens": 1})
        assert status == 400 and "(length 64)" in e["error"]["message"]
        assert s.generate([1] * 60, 100)[3]["usage"]["completion_tokens"] == 4  # max_tokens clamped
        status, e = s.call("/v1/completions", {"model": "other", "prompt": [1], "max_tokens": 1})
        assert status == 404 and e["error"]["type"] == "NotFoundError"
    with serve("sglang", "--max-model-len", "64") as s:
        status, e = s.call("/generate", {"input_ids": [1] * 64, "sampling_params": {"max_new_tokens": 1}})
        assert status == 400 and e == {"error": {"message": "The input (64 tokens) is longer than the model's "
                                                            "context length (64 tokens)."}}
        status, e = s.call("/generate", {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 10}})
        assert status == 400 and "You requested a total of 70 tokens" in e["error"]["message"]


def test_no_routes_and_dense() -> None:
    with serve("vllm", "--no-routes") as s:
        ids, rows, _, _ = s.generate(prompt_of(20), 3)
        assert rows is None and ids == expected(prompt_of(20), 3)[0]
    with serve("sglang", "--no-routes") as s:
        assert s.call("/server_info")[1]["enable_return_routed_experts"] is False
        assert s.generate(prompt_of(20), 3)[1] is None
    for engine in ("vllm", "sglang"):
        with serve(engine, "--dense") as s:
            rows = s.generate(prompt_of(20), 3)[1]
            assert rows is not None and rows.shape == (22, LAYERS, TOP_K) and not rows.any()


def test_slow_and_drop() -> None:
    with serve("vllm", "--slow", "2") as s:
        with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
            s.call("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}, timeout=0.5)
        assert s.call("/version")[0] == 200  # only generation is slow
    with serve("sglang", "--drop") as s:
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError, urllib.error.URLError)):
            s.call("/generate", {"input_ids": [1, 2]})
        assert s.call("/server_info")[0] == 200


# The axes as the audit measures them, each on requests of its own (a fresh salt each, so that no
# request's prefix comes from another's cache unless the axis wants it): for each, the positions
# ([row, layer]) that changed, and the margins there.
PROMPT, OUT = prompt_of(40), 8
CHUNK = 64  # every axis but "chunk" uses sequences shorter than this


def _diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    assert a.shape == b.shape
    changed: np.ndarray = (a != b).any(axis=-1)
    return changed


def measure_axes(s: Server, reference: Server) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """axis -> (changed [n, L], margins [n, L] of the clean model at those rows)."""
    axes = {}
    p, margins = len(PROMPT), expected(PROMPT, OUT)[2]
    # batch: alone, then together with three requests of other lengths.
    alone = s.rows(PROMPT, OUT, salt())
    # The server's first request, alone and uncached: only a decode fault touches its decoded rows and
    # only a continuation fault its prompt rows (the rows the clean model gives, else).
    clean = expected(PROMPT, OUT)[1]
    axes["prompt rows"] = (_diff(alone[:p], clean[:p]), margins[:p])
    axes["decoded rows"] = (_diff(alone[p:], clean[p:]), margins[p:])
    together: dict[int, np.ndarray] = {}

    def send(i: int, prompt: list[int]) -> None:
        together[i] = s.rows(prompt, OUT, salt())

    threads = [threading.Thread(target=send, args=(i, prompt))
               for i, prompt in enumerate([PROMPT, prompt_of(17, 1), prompt_of(29, 2), prompt_of(9, 3)])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    axes["batch"] = (_diff(alone, together[0]), margins)
    # cache: a filler (the prompt's first 20 tokens), a hit (the whole prompt), a salted recompute;
    # stale: the hit's cached rows against the filler's.
    name = salt()
    filler = s.rows(PROMPT[:20], OUT, name)
    _, hit, cached, _ = s.generate(PROMPT, OUT, name)
    assert cached == (16 if s.engine == "vllm" else 20) and hit is not None
    recompute = s.rows(PROMPT, OUT, salt())
    axes["cache"] = (_diff(hit[cached:], recompute[cached:]), margins[cached:])
    axes["stale"] = (_diff(hit[:cached], filler[:cached]), margins[:cached])
    # decode: the decoded rows against the same tokens recomputed as a prompt.
    ids, rollout, _, _ = s.generate(PROMPT, OUT, salt())
    assert ids == expected(PROMPT, OUT)[0] and rollout is not None  # a fault changes routes, never tokens
    axes["decode"] = (_diff(rollout[p:], s.rows(PROMPT + ids, 1, salt())[p:-1]), margins[p:])
    # continuation: the prompt's rows under a short and a long budget.
    axes["continuation"] = (_diff(s.rows(PROMPT, 1, salt())[:p], s.rows(PROMPT, 16, salt())[:p]), margins[:p])
    # chunk: a long prompt here and on a server that differs only in its prefill chunk.
    long = prompt_of(3 * CHUNK, 4)
    axes["chunk"] = (_diff(s.rows(long, 1, salt()), reference.rows(long, 1, salt())), expected(long, 1)[2])
    # repeat: the same request twice.
    axes["repeat"] = (_diff(s.rows(PROMPT, OUT, salt()), s.rows(PROMPT, OUT, salt())), margins)
    return axes


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", [None, *fake.FAULTS])
def test_each_fault_changes_its_axis_only_at_near_ties(engine: str, fault: str | None) -> None:
    faults = ["--fault", fault] if fault else []
    with serve(engine, "--chunk", str(CHUNK), *faults) as s, serve(engine, "--chunk", "8192", *faults) as reference:
        axes = measure_axes(s, reference)
    # What a fault may change: its axis, and the rows of a lone request it names.
    allowed = {fault, *{"continuation": ["prompt rows"], "decode": ["decoded rows"]}.get(fault or "", [])}
    for axis, (changed, margins) in axes.items():
        if axis == fault:
            assert changed.any(), f"--fault {fault} changed nothing on its axis"
        if axis in allowed:
            if axis != "stale":  # a score noise of amplitude NOISE moves a route only at a near-tie
                assert (margins[changed] < 2 * fake.NOISE).all()
            if axis == "batch":  # one layer only
                assert changed[:, [0, 2, 3]].sum() == 0
        elif fault != "repeat":  # repeat: any axis comparing requests of two parities shows it
            assert not changed.any(), f"--fault {fault} changed axis {axis} at {np.argwhere(changed).tolist()}"


def test_bad_flags_exit_2() -> None:
    for flags in (["--top-k", "9"], ["--fault", "nope"], ["--tp", "2"], ["--layers", "0"]):
        run = subprocess.run([sys.executable, str(FAKE), "--engine", "vllm", *flags], capture_output=True, text=True,
                             timeout=30)
        assert run.returncode == 2 and run.stdout == "", (flags, run.stderr)

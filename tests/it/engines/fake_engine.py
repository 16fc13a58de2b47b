#!/usr/bin/env python3
"""A fake vLLM 0.33.0 / SGLang 0.5.23 server for the ``moe-audit engine`` integration tests.

README
------
It answers the HTTP calls the audit makes, with the exact shapes of the two engines' responses
(each one cited below to the release's file and line), around a toy MoE whose routes are known, so
a test can switch on one defect at a time and check that the audit finds that axis and no other.
Python 3.9+, the standard library and numpy; no GPU, no model.

    python tests/it/engines/fake_engine.py --engine vllm --port 0 [--fault decode] ...
    # stdout: "READY <port>" once listening; SIGTERM or SIGINT: exit 0

Endpoints. vLLM: ``GET /version``, ``GET /v1/models``, ``GET /health``, ``POST /v1/completions``
(token-id prompt, non-streaming); no ``/server_info`` (vLLM serves it in dev mode only).
SGLang: ``GET /server_info`` (and ``/get_server_info``), ``GET /model_info``, ``GET /v1/models``,
``GET /health``, ``POST /generate`` (``input_ids``, non-streaming); no ``/version``. Anything else:
404 ``{"detail": "Not Found"}`` as FastAPI answers.

The toy model (seeded by ``--seed``; ``--layers`` 4, ``--experts`` 8, ``--top-k`` 2, ``--vocab``
256, ``--max-model-len`` 2048). A token's route in a layer is the top-k (score descending) of E
scores in [0, 1) hashed from (seed, layer, expert, a rolling hash of tokens[0..=t]): causal and
batch-invariant. The greedy next token is a hash of the whole prefix mod V, never of the routes,
so a fault changes routes and never tokens. Generation is greedy whatever the temperature; there
is no EOS, every request runs to its token budget (``finish_reason`` length); no tokenizer, so
``text`` is always "". vLLM's and SGLang's servers with one seed give the same rows. Rows cover the
P + O - 1 tokens that were forwarded (the last sampled token never is): row t < P is prefill,
row t >= P a decode step.

Prefix cache, per namespace (vLLM: ``cache_salt``; SGLang: ``extra_key`` and ``cache_salt``): a
request's rows of a cache hit are the stored copies of the request that filled it (vLLM and
SGLang both return stored rows), and the hit is reported as cached tokens. vLLM: blocks of 16,
full blocks only, at most P - 1 tokens. SGLang: page 1, at most P - 1 tokens;
``--disable-radix-cache`` turns it off. All forwarded tokens (prompt and decoded) are stored.

Faults (``--fault NAME``, repeatable; each perturbs the scores of the (row, layer) pairs it names
by a seeded noise of amplitude ``NOISE`` = 0.02, so a route (its set or its order) changes only
where two of its k + 1 best scores are closer than 2 * NOISE, a near-tie; about 10% of the rows
touched change with the defaults):
  batch         layer min(1, L - 1), every row, when another request was in flight with it
  stale         a cache hit returns the stored rows shifted down by one (row i gets row i - 1)
  cache         a cache hit's uncached prompt rows [C, P) (the prefill that follows the hit)
  decode        decode rows [P, P + O - 1)
  continuation  prompt rows when max_tokens > 1, the noise seeded by max_tokens
  repeat        every row of every other generation request (a global counter, odd ones)
  chunk         prompt rows [N, P), N = ``--chunk`` (default 8192, SGLang's chunked_prefill_size;
                positions from the sequence start, so a cache hit does not move them)
Other flags: ``--no-routes`` (vLLM: ``routed_experts`` null; SGLang: ``enable_return_routed_experts``
false and no ``routed_experts``), ``--dense`` (every route id 0), ``--slow S`` (a generation
request sleeps S more seconds), ``--drop`` (a generation request's connection is closed unanswered),
``--enable-prompt-tokens-details`` (vLLM: ``usage.prompt_tokens_details``), ``--tp``/``--ep``
(reported by SGLang's ``/server_info``). A generation request waits ``--wait`` (0.05 s) after it
arrives, so requests sent together overlap; two requests overlap when one arrives while the other
is in flight.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import sys
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.23"
FAULTS = ("batch", "stale", "cache", "decode", "continuation", "repeat", "chunk")
# Amplitude of a fault's score noise: a route changes only where its margin is below 2 * NOISE. With
# 8 experts and top-2 about 10% of the (token, layer) rows a fault touches change (5% as sets).
NOISE = 0.02
MAX_BODY = 1 << 24
CACHE_ENTRIES = 1 << 20
_MASK = (1 << 64) - 1
# One seeded stream per use, so that no two uses of the hash coincide.
_T_PREFIX, _T_TOKEN, _T_SCORE = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0xA0761D6478BD642F
_T_BATCH, _T_CACHE, _T_DECODE, _T_CONT, _T_REPEAT, _T_CHUNK = range(101, 107)


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """The same finaliser elementwise on a uint64 array (numpy arrays wrap on overflow)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def _unit(x: np.ndarray) -> np.ndarray:
    """Uniform floats in [0, 1) from the top 53 bits."""
    unit: np.ndarray = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return unit


class ToyMoE:
    """The model: prefix hashes, greedy tokens and routes; no state, so threads share it."""

    def __init__(self, seed: int, layers: int, experts: int, top_k: int, vocab: int) -> None:
        self.seed, self.layers, self.experts, self.top_k, self.vocab = seed, layers, experts, top_k, vocab
        ids = np.arange(layers * experts, dtype=np.uint64).reshape(layers, experts)
        self._keys = _mix_array(ids ^ np.uint64(_mix(seed ^ _T_SCORE)))

    def prefix_hashes(self, tokens: list[int]) -> list[int]:
        """h[t] depends on tokens[0..=t] and the seed only."""
        h, out = _mix(self.seed ^ _T_PREFIX), []
        for token in tokens:
            h = _mix(h ^ _mix(token + _T_PREFIX))
            out.append(h)
        return out

    def next_token(self, h: int) -> int:
        return _mix(h ^ _T_TOKEN) % self.vocab

    def scores(self, hashes: list[int], tags: np.ndarray | None = None) -> np.ndarray:
        """[n, L, E] scores; where tags[t, l] != 0, plus a noise of amplitude NOISE seeded by it."""
        h = np.array(hashes, dtype=np.uint64).reshape(-1, 1, 1)
        s = _unit(_mix_array(h ^ self._keys))
        if tags is not None and tags.any():
            noise = _unit(_mix_array(h ^ self._keys ^ tags[:, :, None])) * 2.0 - 1.0
            s = s + NOISE * noise * (tags != 0)[:, :, None]
        return s

    def route(self, hashes: list[int], tags: np.ndarray | None = None) -> np.ndarray:
        """[n, L, K] expert ids, by score descending, index ascending on equal scores."""
        order = np.argsort(-self.scores(hashes, tags), axis=-1, kind="stable")
        return order[..., : self.top_k].astype(np.int64)

    def margins(self, hashes: list[int]) -> np.ndarray:
        """[n, L] the smallest gap between consecutive scores among the k + 1 best: a row (its set or
        its order) can change under a noise of amplitude a only where this is below 2 * a."""
        s = -np.sort(-self.scores(hashes), axis=-1)[..., : self.top_k + 1]
        if s.shape[-1] < 2:  # one expert: nothing can change
            return np.full(s.shape[:2], np.inf)
        gaps: np.ndarray = np.min(s[..., :-1] - s[..., 1:], axis=-1)
        return gaps


@dataclass
class Generation:
    output_ids: list[int]
    rows: np.ndarray  # [P + O - 1 - start, L, K]
    cached: int


class RequestError(Exception):
    """A request the engine refuses: its HTTP status, message and (vLLM) parameter."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


class Engine:
    """The serving side: the prefix cache, requests in flight, the faults."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = ToyMoE(args.seed, args.layers, args.experts, args.top_k, args.vocab)
        self.faults: set[str] = set(args.fault)
        # vLLM's default block size 16; SGLang's page size 1 (schedule_batch.py:1766-1785 limits
        # a radix match to P - 1, page-aligned).
        self.block = 16 if args.engine == "vllm" else 1
        self.caching = not args.disable_radix_cache
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Any, int, int], np.ndarray] = OrderedDict()
        self._in_flight: dict[int, bool] = {}  # request number -> overlapped another request
        self._requests = 0

    def generate(self, prompt: list[int], max_tokens: int, namespace: Any, start: int) -> Generation:
        with self._lock:
            number = self._requests
            self._requests += 1
            for other in self._in_flight:
                self._in_flight[other] = True
            self._in_flight[number] = bool(self._in_flight)
        time.sleep(self.args.wait + self.args.slow)
        with self._lock:
            try:
                return self._run(prompt, max_tokens, namespace, start, number, self._in_flight[number])
            finally:
                del self._in_flight[number]

    def _run(self, prompt: list[int], max_tokens: int, namespace: Any, start: int, number: int,
             batched: bool) -> Generation:
        m, p = self.model, len(prompt)
        hashes = m.prefix_hashes(prompt)
        output: list[int] = []
        for _ in range(max_tokens):
            output.append(m.next_token(hashes[-1]))
            if len(output) < max_tokens:  # the last sampled token is never forwarded
                hashes.append(_mix(hashes[-1] ^ _mix(output[-1] + _T_PREFIX)))
        n = len(hashes) if max_tokens > 0 else p - 1
        hashes = hashes[:n]
        cached_rows = self._lookup(namespace, hashes, p)
        cached = len(cached_rows)
        tags = np.zeros((n, m.layers), dtype=np.uint64)

        def perturb(rows: slice, layers: slice, tag: int) -> None:
            tags[rows, layers] ^= np.uint64(_mix(tag ^ self.args.seed))

        if "batch" in self.faults and batched:
            layer = min(1, m.layers - 1)
            perturb(slice(0, n), slice(layer, layer + 1), _T_BATCH)
        if "cache" in self.faults and cached > 0:
            perturb(slice(cached, p), slice(None), _T_CACHE)
        if "decode" in self.faults:
            perturb(slice(p, n), slice(None), _T_DECODE)
        if "continuation" in self.faults and max_tokens > 1:
            perturb(slice(0, p), slice(None), _mix(_T_CONT ^ max_tokens))
        if "repeat" in self.faults and number % 2 == 1:
            perturb(slice(0, n), slice(None), _T_REPEAT)
        if "chunk" in self.faults:
            perturb(slice(self.args.chunk, p), slice(None), _T_CHUNK)
        computed = m.route(hashes[cached:], tags[cached:]) if n > cached else np.zeros((0, m.layers, m.top_k))
        rows = np.concatenate([np.array(cached_rows).reshape(-1, m.layers, m.top_k), computed]).astype(np.int64)
        self._store(namespace, hashes, rows)
        if "stale" in self.faults and cached > 1:
            rows = rows.copy()
            rows[1:cached] = rows[: cached - 1]
        if self.args.dense:
            rows = np.zeros_like(rows)
        return Generation(output, rows[start:], cached)

    def _key(self, namespace: Any, hashes: list[int], end: int) -> tuple[Any, int, int]:
        return (namespace, end, hashes[end - 1])

    def _lookup(self, namespace: Any, hashes: list[int], prompt_len: int) -> list[np.ndarray]:
        """The stored rows of the longest cached prefix: whole blocks, at most P - 1 tokens (vLLM never
        serves the last prompt token from the cache: vllm/v1/core/kv_cache_manager.py:295-302)."""
        rows: list[np.ndarray] = []
        if not self.caching:
            return rows
        for end in range(self.block, prompt_len, self.block):
            block = self._cache.get(self._key(namespace, hashes, end))
            if block is None:
                break
            self._cache.move_to_end(self._key(namespace, hashes, end))
            rows.extend(block)
        return rows

    def _store(self, namespace: Any, hashes: list[int], rows: np.ndarray) -> None:
        if not self.caching:
            return
        for end in range(self.block, len(hashes) + 1, self.block):
            key = self._key(namespace, hashes, end)
            if key not in self._cache:
                self._cache[key] = rows[end - self.block : end].copy()
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise RequestError(f"{what} must be a list of token ids (this fake takes no text)", param=what)
    return value


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    return value


class VllmApi:
    """vLLM 0.33.0's OpenAI server, as the audit calls it."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.args = engine, engine.args

    def get(self, path: str) -> tuple[int, Any] | None:
        if path == "/version":  # vllm/entrypoints/serve/instrumentator/basic.py:53-56
            return 200, {"version": VLLM_VERSION}
        if path == "/v1/models":  # vllm/entrypoints/serve/engine/protocol.py:105-118 (ModelCard, ModelList)
            card = {"id": self.args.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                    "root": self.args.model, "parent": None, "max_model_len": self.args.max_model_len,
                    "permission": []}
            return 200, {"object": "list", "data": [card]}
        if path == "/health":
            return 200, None
        return None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if path != "/v1/completions":
            return None
        try:
            return 200, self._completion(body)
        except RequestError as e:
            # vllm/entrypoints/serve/exception_handling/error_response.py:14-45 and
            # vllm/entrypoints/serve/engine/protocol.py:79-87: ErrorResponse{error: ErrorInfo}.
            kind = "NotFoundError" if e.status == 404 else "BadRequestError"
            return e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.status}}

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        model = body.get("model")
        if model and model != a.model:  # vllm/entrypoints/serve/engine/serving.py:75-84
            raise RequestError(f"The model `{model}` does not exist. Valid aliases: {a.model}.", 404, "model")
        if body.get("stream"):
            raise RequestError("this fake answers non-streaming requests only", param="stream")
        # vllm/entrypoints/openai/completion/protocol.py:53-59: a prompt of token ids, each >= 0.
        prompt = _int_list(body.get("prompt"), "prompt")
        salt = body.get("cache_salt")
        # vllm/entrypoints/generate/base/protocol.py:42-58
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise RequestError("Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
        if isinstance(salt, str) and (len(salt) > 128 or any(c in "@/\\\0" for c in salt)):
            raise RequestError("Parameter 'cache_salt' must be at most 128 characters and must "
                               "not contain '@', '/', '\\\\', or NUL.", param="cache_salt")
        p, limit = len(prompt), a.max_model_len
        # vllm/renderers/params.py:536-548 (the prompt alone is too long)
        if p > limit:
            qualifier = "at least " if p == limit + 1 else ""
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt "
                               f"contains {qualifier}{p} input tokens, which exceeds this limit even without any "
                               "output tokens. Please reduce the length of the input prompt.", param="input_tokens")
        if p == 0:  # vllm/v1/engine/input_processor.py:568-569
            raise RequestError("The decoder prompt cannot be empty")
        if p == limit:  # vllm/v1/engine/input_processor.py:596-604
            raise RequestError(f"The decoder prompt (length {p}) plus the number of requested output tokens "
                               f"(at least 1) is longer than the maximum model length of {limit}. Make sure that "
                               "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                               "output tokens).")
        # vllm/renderers/base.py:453-490 (no parameter named: vllm/v1/engine/input_processor.py:647)
        bad = [t for t in prompt if t < 0 or t >= a.vocab]
        if bad:
            raise RequestError(f"Token id {min(bad) if min(bad) < 0 else max(bad)} is out of vocabulary")
        requested = _int_field(body, "max_tokens", None)
        # vllm/entrypoints/serve/utils/api_utils.py:234-270: max_tokens is clamped to the room left.
        max_tokens = limit - p if requested is None else min(requested, limit - p)
        if max_tokens < 1:  # vllm/sampling_params.py:693
            raise RequestError(f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        start = _int_field(body, "routed_experts_prompt_start", 0) or 0
        if not 0 <= start <= p:  # vllm/v1/engine/input_processor.py:457-463
            raise RequestError(f"routed_experts_prompt_start must be between 0 and the prompt length ({p}), "
                               "inclusive.", param="routed_experts_prompt_start")
        out = self.engine.generate(prompt, max_tokens, salt, start)
        ids = bool(body.get("return_token_ids"))
        # vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:69 (the dtype) and
        # vllm/utils/serial_utils.py:67-71 (numpy2base64: np.save, base64).
        routes = None
        if not a.no_routes:
            buffer = io.BytesIO()
            np.save(buffer, out.rows.astype(np.uint8 if a.experts <= 256 else np.uint16), allow_pickle=False)
            routes = base64.b64encode(buffer.getvalue()).decode("ascii")
        # vllm/entrypoints/openai/completion/protocol.py:675-722 (the choice, the response: model_dump
        # keeps the None fields) and completion/serving.py:630-672.
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "token_ids": out.output_ids if ids else None, "prompt_logprobs": None,
                  "prompt_token_ids": prompt if ids else None, "routed_experts": routes, "weight_versions": None}
        o = len(out.output_ids)
        details = {"cached_tokens": out.cached, "created_cache_tokens": None, "multimodal_tokens": None}
        usage = {"prompt_tokens": p, "total_tokens": p + o, "completion_tokens": o,
                 "prompt_tokens_details": details if a.enable_prompt_tokens_details else None,
                 "completion_tokens_details": None}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": a.model, "choices": [choice], "service_tier": None, "system_fingerprint": None,
                "usage": usage, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


class SglangApi:
    """SGLang 0.5.23's native server, as the audit calls it."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.args = engine, engine.args

    def server_info(self) -> dict[str, Any]:
        """sglang/srt/entrypoints/http_server.py:863-893: the resolved server args (flat,
        sglang/srt/server_args.py:316-333), the scheduler's info (sglang/srt/managers/scheduler.py:1943-1947),
        the version. Fields: sglang/srt/arg_groups/fields/{model,schedule,memory,parallel,exec_}.py."""
        a = self.args
        return {"model_path": a.model, "served_model_name": a.model, "tokenizer_path": a.model,
                "context_length": a.max_model_len, "random_seed": a.seed, "tp_size": a.tp, "ep_size": a.ep,
                "dp_size": 1, "pp_size": 1, "page_size": 1, "chunked_prefill_size": a.chunk,
                "disable_radix_cache": a.disable_radix_cache, "enable_return_routed_experts": not a.no_routes,
                "enable_deterministic_inference": False, "skip_tokenizer_init": False,
                "launch_command": " ".join(sys.argv), "status": "ready", "max_total_num_tokens": 1 << 20,
                "max_req_input_len": a.max_model_len - 1, "internal_states": [{}], "version": SGLANG_VERSION,
                "frontend": "python"}

    def get(self, path: str) -> tuple[int, Any] | None:
        a = self.args
        if path in ("/server_info", "/get_server_info"):
            return 200, self.server_info()
        if path in ("/model_info", "/get_model_info"):  # sglang/srt/entrypoints/http_server.py:812-840
            return 200, {"model_path": a.model, "served_model_name": a.model, "is_generation": True,
                         "weight_version": "default", "model_type": "toy_moe", "architectures": ["ToyMoEForCausalLM"]}
        if path == "/v1/models":  # sglang/srt/entrypoints/http_server.py:1993-2022
            card = {"id": a.model, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                    "root": a.model, "parent": None, "max_model_len": a.max_model_len}
            return 200, {"object": "list", "data": [card]}
        if path == "/health":
            return 200, None
        return None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any] | None:
        if path != "/generate":
            return None
        try:
            return 200, self._generate(body)
        except RequestError as e:  # sglang/srt/entrypoints/http_server.py:2246-2250
            return e.status, {"error": {"message": str(e)}}

    def _generate(self, body: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        if body.get("stream"):
            raise RequestError("this fake answers non-streaming requests only")
        prompt = _int_list(body.get("input_ids"), "input_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        max_new = _int_field(params, "max_new_tokens", 128)  # sglang/srt/sampling/sampling_params.py:149
        assert max_new is not None
        if max_new < 0:  # sglang/srt/sampling/sampling_params.py:285-289
            raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
        p, limit = len(prompt), a.max_model_len
        if p == 0:
            raise RequestError("input_ids is empty")
        # sglang/srt/managers/tokenizer_manager.py:1336-1377 (no truncation by default). SGLang 0.5.23
        # checks input ids against the vocabulary nowhere before the model: neither does this fake.
        if p >= limit:
            raise RequestError(f"The input ({p} tokens) is longer than the model's context length ({limit} tokens).")
        if max_new + p > limit:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {limit} tokens. You requested "
                f"a total of {max_new + p} tokens: {p} tokens from the input messages and {max_new} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion to fit "
                "within the limit.")
        # sglang/srt/managers/io_struct.py:263-268
        start = _int_field(body, "routed_experts_start_len", 0) or 0
        if start < 0:  # sglang/srt/managers/scheduler.py:3300-3313 (reported as an abort: a 400 here)
            raise RequestError(f"recv_req.routed_experts_start_len={start} is lower than 0. "
                               "Please use a non-negative routed_experts_start_len.")
        if start > p:
            raise RequestError(f"recv_req.routed_experts_start_len={start} is higher than the number of input "
                               f"tokens len(req.origin_input_ids)={p}. Please use a smaller routed_experts_start_len.")
        # sglang/srt/managers/io_struct.py:325,370 and schedule_batch.py:1164-1171: both keys split the cache.
        namespace = (body.get("extra_key") or None, body.get("cache_salt") or None)
        out = self.engine.generate(prompt, max_new, namespace, start)
        o = len(out.output_ids)
        # sglang/srt/managers/tokenizer_manager.py:2507-2513 and 2552-2558; finish_reason:
        # sglang/srt/managers/schedule_batch.py:320-329.
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "finish_reason": {"type": "length", "length": o},
                                "prompt_tokens": p, "weight_version": "default", "num_retractions": 0,
                                "reasoning_tokens": 0, "completion_tokens": o, "cached_tokens": out.cached}
        # sglang/srt/managers/scheduler_components/batch_result_processor.py:149-161 (nothing without the
        # server flag or the request's) and tokenizer_manager.py:2602-2609 / detokenizer_manager.py:432-447:
        # the int32 rows' raw bytes (state_capturer/routed_experts.py:105,168-173), base64, no shape.
        if body.get("return_routed_experts") and not a.no_routes:
            raw = np.ascontiguousarray(out.rows, dtype=np.int32).tobytes()
            meta["routed_experts"] = base64.b64encode(raw).decode("utf-8")
        meta["e2e_latency"] = 0.0
        # sglang/srt/managers/tokenizer_manager.py:2651-2654
        return {"text": "", "output_ids": out.output_ids, "meta_info": meta}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _send(self, status: int, payload: Any) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        answer = self.server.api.get(self.path.split("?", 1)[0])
        self._send(*(answer or (404, {"detail": "Not Found"})))

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            self._send(413, {"detail": "request body too large"})
            return
        raw = self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        if path in ("/v1/completions", "/generate") and self.server.engine.args.drop:
            self.close_connection = True  # no answer: the client sees the connection closed
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body is not a JSON object")
        except ValueError as e:
            self._send(400, {"error": {"message": f"invalid JSON body: {e}", "type": "BadRequestError",
                                       "param": None, "code": 400}})
            return
        answer = self.server.api.post(path, body)
        self._send(*(answer or (404, {"detail": "Not Found"})))


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], engine: Engine) -> None:
        super().__init__(address, Handler)
        self.engine = engine
        self.api: VllmApi | SglangApi = VllmApi(engine) if engine.args.engine == "vllm" else SglangApi(engine)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    p.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed as READY <port>)")
    p.add_argument("--model", default="fake/toy-moe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--fault", action="append", default=[], choices=FAULTS)
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (SGLang's chunked_prefill_size)")
    p.add_argument("--no-routes", action="store_true")
    p.add_argument("--dense", action="store_true")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--drop", action="store_true")
    p.add_argument("--wait", type=float, default=0.05)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    a = p.parse_args(argv)
    if min(a.layers, a.experts, a.top_k, a.vocab, a.max_model_len, a.chunk, a.tp, a.ep) < 1:
        p.error("--layers, --experts, --top-k, --vocab, --max-model-len, --chunk, --tp and --ep must be >= 1")
    if a.top_k > a.experts:
        p.error(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    if a.experts > 65536:
        p.error("--experts above 65536 does not fit vLLM's uint16 payload")
    if a.slow < 0 or a.wait < 0:
        p.error("--slow and --wait must be >= 0")
    if a.engine == "vllm" and (a.disable_radix_cache or a.tp != 1 or a.ep != 1):
        p.error("--disable-radix-cache, --tp and --ep are SGLang's (vLLM's routes need its prefix cache: "
                "vllm/config/vllm.py:1187-1244)")
    if a.engine == "sglang" and a.enable_prompt_tokens_details:
        p.error("--enable-prompt-tokens-details is vLLM's")
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    server = FakeServer((args.host, args.port), Engine(args))

    def stop(_signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Serve an MoE layer that runs expert-parallel over ``torch.distributed`` ranks to moe-audit
(``moe-audit/2`` with ``ranks`` and ``output``: docs/DISTRIBUTED.md, docs/PROTOCOL.md).

The user's script builds the layer as training does (process groups initialised as usual) and
hands it to a framework adapter (:mod:`moe_audit.megatron`, :mod:`moe_audit.deepspeed`,
:mod:`moe_audit.torchtitan`), which wraps it in a :class:`Driver` and calls :func:`serve` on every
rank. The script is launched as users launch training::

    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 ep.py"

Rank 0 speaks the protocol. Per call it broadcasts the request to every rank; each rank takes its
sequences (the request's ``placement``, else this adapter's default: ``"contiguous"``, sequence b
on rank ``b // (batch / ranks)`` as a loader that hands each rank a consecutive slice of the
micro-batch, or ``"strided"``, rank ``b % ranks`` as torch's ``DistributedSampler``,
``indices[rank::num_replicas]``) and runs the layer on them, collectively; rank 0 gathers every
rank's routes, capacity and output rows and answers with the placement it used. Every rank holds
``batch / ranks`` sequences, as a data-parallel loader gives each rank the same micro-batch size.

Importing this module under a launcher (``RANK`` set) moves every rank's stdout to stderr at once
(file descriptor 1 included, so prints from C code and from other ranks too: the launcher's
workers share its stdout, torch ``elastic/multiprocessing/api.py``), keeping rank 0's real stdout
for the protocol; and an uncaught exception on any rank is written as one line
``moe-audit: rank R: Type: message`` before the traceback, which moe-audit quotes. A rank that
stops answering is named by rank 0's watchdog: each rank records its progress in the launcher's
key-value store, and a call not done within 0.8 of moe-audit's ``--timeout``
(``MOE_AUDIT_TIMEOUT``) ends rank 0 with the line naming the ranks that lag.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Callable, Protocol, Union

import numpy as np

from ._wire import v2

#: How a call's sequences are spread over the ranks when the request does not say.
PLACEMENTS = ("contiguous", "strided")

#: The prefix of the one line a failing rank writes; moe-audit quotes the last such line.
FAULT = "moe-audit: rank"

_STORE_KEY = "moe_audit/progress/{rank}"


@dataclass
class Local:
    """One rank's answer for its local micro-batch, tokens sequence-major over it
    (``b_local * seq_len + s``)."""

    experts: np.ndarray  #: [T_local, k] int64 expert ids, in choice order
    weights: np.ndarray  #: [T_local, k] combine weights (for a dropped route: its gate before dropping)
    kept: np.ndarray  #: [T_local, k] bool
    capacity: int | None  #: this rank's slots per expert; None when dropless
    output: np.ndarray | None  #: [T_local, H] float32, the layer's output rows


class Driver(Protocol):
    """A framework's MoE layer on this rank, as :func:`serve` runs it."""

    name: str
    experts: int
    top_k: int
    hidden_size: int
    #: The dtype the layer computes its output in ("float32", "bfloat16", "float16"): moe-audit's
    #: output tolerance follows it.
    output_dtype: str

    def forward(self, hidden: Any, mode: str, seed: int | None) -> Local:
        """Runs the layer on this rank's ``[b_local, seq_len, hidden]`` float32 torch tensor
        (its sequences in ascending batch order) in mode "train" or "inference"; collective."""
        ...

    def fingerprint(self) -> str | None:
        """A digest of the layer's weights, the same on every rank (collective), equal for the
        same layer at any expert-parallel size; None when the layer cannot say."""
        ...


def _rank_from_env() -> int | None:
    rank = os.environ.get("RANK")
    return int(rank) if rank is not None and rank.isdigit() else None


def _rank_label() -> int | str:
    rank = _rank_from_env()
    return "?" if rank is None else rank


def fault(rank: int | str, problem: str) -> None:
    """Writes the one line moe-audit quotes for a rank's failure, to file descriptor 2 itself:
    torch's excepthook captures ``sys.stderr`` and prefixes each line with ``[rankN]: ``
    (torch/distributed/distributed_c10d.py:2743-2764, torch 2.15)."""
    sys.stderr.flush()
    os.write(2, f"{FAULT} {rank}: {' '.join(problem.split())}\n".encode())


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    traceback.print_exception(kind, value, tb)
    fault(_rank_label(), f"{kind.__name__}: {value}")


_protocol_out: BinaryIO | None = None


def _protect_stdout() -> None:
    """Under a launcher: stdout (fd 1 too) goes to stderr on every rank; rank 0 keeps a copy of
    the real stdout for the protocol. Uncaught exceptions end with the fault line."""
    global _protocol_out
    rank = _rank_from_env()
    if rank is None or _protocol_out is not None:
        return
    sys.stdout.flush()
    if rank == 0:
        _protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.excepthook = _excepthook


_protect_stdout()


def protocol_stdout() -> BinaryIO:
    """Where the protocol is written: rank 0's real stdout kept aside under a launcher, else stdout."""
    return _protocol_out or sys.stdout.buffer


def placement(kind: str, batch: int, ranks: int) -> list[int]:
    """The rank of each of batch sequences: ``contiguous`` or ``strided`` (see the module doc)."""
    if kind not in PLACEMENTS:
        raise ValueError(f"moe_audit.distributed: placement {kind!r} is not one of {', '.join(PLACEMENTS)}")
    if batch % ranks:
        raise ValueError(f"moe_audit.distributed: a batch of {batch} sequences does not split over {ranks} ranks")
    per = batch // ranks
    return [b // per if kind == "contiguous" else b % ranks for b in range(batch)]


def _checked_placement(given: Any, batch: int, ranks: int) -> list[int]:
    """A request's placement: batch ranks, each rank holding batch / ranks sequences."""
    if not isinstance(given, list) or len(given) != batch or not all(isinstance(r, int) for r in given):
        raise ValueError(f"moe_audit.distributed: placement {given!r} is not one rank per sequence ({batch})")
    counts = np.bincount(np.asarray(given, dtype=np.int64).clip(0, ranks), minlength=ranks + 1)
    if counts[ranks] or min(given) < 0 or (counts[:ranks] != batch // ranks).any():
        raise ValueError(f"moe_audit.distributed: placement {given} does not give each of {ranks} ranks "
                         f"{batch // ranks} sequences")
    return list(given)


class _Progress:
    """Each rank's progress in the launcher's store (``call:stage``, stage ``received`` then
    ``done`` after its forward), and rank 0's watchdog: a call not answered within the limit ends
    the process naming the ranks that have not finished it."""

    def __init__(self, rank: int, ranks: int, limit: float) -> None:
        import torch.distributed as dist

        self.rank, self.ranks, self.limit = rank, ranks, limit
        try:
            self.store: Any = dist.distributed_c10d._get_default_store()
        except Exception:  # no default store (a process group made without one): no names, still the timeout
            self.store = None
        self.started: float | None = None
        self.call = 0
        self.lock = threading.Lock()
        if rank == 0:
            threading.Thread(target=self._watch, daemon=True).start()

    def mark(self, call: int, stage: str) -> None:
        self.call = call
        if self.store is not None:
            self.store.set(_STORE_KEY.format(rank=self.rank), f"{call}:{stage}")
        if self.rank == 0 and stage in ("received", "answered"):
            with self.lock:
                self.started = time.monotonic() if stage == "received" else None

    def lagging(self, skip: int | None = None) -> str:
        """The ranks (but skip) that have not finished the current call, with their last stage
        (``failed: <error>`` for a rank that recorded its failure)."""
        if self.store is None:
            return "the other ranks (no key-value store to ask)"
        behind = []
        for r in range(self.ranks):
            key = _STORE_KEY.format(rank=r)
            try:
                state = self.store.get(key).decode() if self.store.check([key]) else "not started"
            except Exception:  # the store went away with its rank
                state = "unreachable"
            if r != skip and state not in (f"{self.call}:done", f"{self.call}:answered"):
                behind.append(f"rank {r} ({state})")
        return ", ".join(behind)

    def failed(self, problem: str) -> str:
        """Records this rank's failure for rank 0 to name; on rank 0, problem with the other
        ranks that have not finished the call (one may be the cause)."""
        try:
            self.mark(self.call, f"failed: {problem}")
        except Exception:  # the store is gone: the launch is ending anyway
            return problem
        others = self.lagging(skip=0) if self.rank == 0 else ""
        return f"{problem}; other ranks: {others}" if others else problem

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            with self.lock:
                late = self.started is not None and time.monotonic() - self.started > self.limit
                call = self.call
            if late:
                fault(0, f"call {call} not done within {self.limit:g} s; waiting on {self.lagging() or 'none'}")
                os._exit(1)


def _limit() -> float:
    """0.8 of moe-audit's --timeout (MOE_AUDIT_TIMEOUT), so rank 0 names a hung rank before
    moe-audit gives up on the whole launch; 60 s without it."""
    try:
        return 0.8 * float(os.environ.get("MOE_AUDIT_TIMEOUT", "75"))
    except ValueError:
        return 60.0


def fingerprint_of(parts: list[bytes]) -> str:
    """A short hex digest of byte strings in order."""
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:32]


def experts_fingerprint(router_weight: Any, local_experts: Any, group: Any) -> str | None:
    """:func:`fingerprint_of` the router's weight and every expert's parameters (each sorted by
    name) in global expert order, local expert i of EP rank r being global expert r * local + i,
    gathered over the expert-parallel ``group`` (collective); None when a rank has no such list
    (``local_experts`` None: a layout that changes with the EP size)."""
    import torch.distributed as dist

    mine = None if local_experts is None else [
        b"".join(p.detach().float().cpu().numpy().tobytes() for _, p in sorted(e.named_parameters()))
        for e in local_experts]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(m is None for m in everyone):
        return None
    router = router_weight.detach().float().cpu().numpy().tobytes()
    return fingerprint_of([router] + [e for rank in everyone for e in rank])


def seed_experts(router_weight: Any, local_experts: Any, first: int, seed: int, std: float) -> None:
    """Draws the router's weight from ``seed`` and each local expert's parameters (sorted by name)
    from a generator keyed by its global id (``first`` + its local index), so a layer built at any
    expert-parallel size gets the same weights."""
    import torch

    with torch.no_grad():
        router_weight.copy_(torch.randn(router_weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
        for i, expert in enumerate(local_experts):
            g = torch.Generator().manual_seed(seed * 1_000_003 + first + i + 1)
            for _, p in sorted(expert.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _assemble(locals_: list[Local], order: list[list[int]], batch: int, seq_len: int
              ) -> tuple[tuple[np.ndarray, ...], Any, np.ndarray | None]:
    """Every rank's answer in the call's order: (experts, weights, kept) [T, k], the capacity
    ({"scope": "rank", ...} or None) and the output rows [T, H] (or None)."""
    k = locals_[0].experts.shape[1]
    experts = np.zeros((batch, seq_len, k), dtype=np.int64)
    weights = np.zeros((batch, seq_len, k), dtype=np.float64)
    kept = np.zeros((batch, seq_len, k), dtype=bool)
    with_output = locals_[0].output is not None
    output = None
    for rank, (local, seqs) in enumerate(zip(locals_, order)):
        n = len(seqs) * seq_len
        if local.experts.shape != (n, k) or local.weights.shape != (n, k) or local.kept.shape != (n, k):
            raise RuntimeError(f"moe_audit.distributed: rank {rank} answered routes of shape {local.experts.shape}, "
                               f"expected ({n}, {k}) for its {len(seqs)} sequences of {seq_len} tokens")
        experts[seqs] = local.experts.reshape(len(seqs), seq_len, k)
        weights[seqs] = local.weights.reshape(len(seqs), seq_len, k)
        kept[seqs] = local.kept.reshape(len(seqs), seq_len, k)
        if (local.output is not None) != with_output:
            raise RuntimeError(f"moe_audit.distributed: rank {rank} {'lacks' if with_output else 'adds'} output rows")
        if local.output is not None:
            if output is None:
                output = np.zeros((batch, seq_len, local.output.shape[-1]), dtype=np.float32)
            output[seqs] = local.output.reshape(len(seqs), seq_len, -1)
    capacities = [local.capacity for local in locals_]
    if all(c is None for c in capacities):
        capacity = None
    elif any(c is None for c in capacities):
        raise RuntimeError(f"moe_audit.distributed: ranks disagree on dropping: capacities {capacities}")
    else:
        capacity = {"scope": "rank", "slots": [int(c) for c in capacities if c is not None]}
    arrays = tuple(a.reshape(batch * seq_len, k) for a in (experts, weights, kept))
    rows = None if output is None else output.reshape(batch * seq_len, -1)
    return arrays, capacity, rows


class ModelDriver(Protocol):
    """A framework's whole model on this rank, token ids in (``moe-audit/3``)."""

    name: str
    vocab: int
    #: The handshake's layers: every decoder layer by global number, ``{"layer", "kind"}`` and
    #: for a routed one ``"experts"`` and ``"top_k"``.
    layers: list[dict[str, Any]]
    #: Width of the output rows (0: none).
    outputs: int

    def forward(self, ids: Any, mode: str, seed: int | None) -> tuple[list[Local], np.ndarray | None]:
        """Runs the model on this rank's ``[b_local, seq_len]`` int64 token ids: each routed
        layer's answer (in handshake order, without output rows) and the output rows [T_local, D]."""
        ...

    def fingerprint(self) -> str | None:
        """As :meth:`Driver.fingerprint`."""
        ...


@dataclass
class _Call:
    """A request as every rank sees it."""

    id: int
    mode: str
    seed: int | None
    shape: tuple[int, ...]
    dtype: Any
    placement: list[int]

    def sequences(self, ranks: int) -> list[list[int]]:
        """Each rank's sequences, in ascending batch order."""
        return [[b for b, r in enumerate(self.placement) if r == rank] for rank in range(ranks)]


class _Layer:
    """``moe-audit/2`` with ``ranks`` and ``output``: a layer on hidden states."""

    def __init__(self, driver: Driver, placement_kind: str) -> None:
        self.driver, self.placement_kind = driver, placement_kind

    def handshake(self, ranks: int, weights: str | None) -> dict[str, Any]:
        from . import adapter

        d = self.driver
        hs = adapter.handshake(d.name, d.experts, d.top_k, "hidden", d.hidden_size,
                               seed_calls=getattr(d, "seed_calls", None))
        hs.update(ranks=ranks, output=d.output_dtype)
        if weights is not None:
            hs["weights"] = weights
        return hs

    def read(self, inp: BinaryIO, ranks: int) -> tuple[_Call, np.ndarray] | None:
        req = v2.read_request(inp, self.driver.hidden_size)
        if req is None:
            return None
        batch = req.data.shape[0]
        where = (_checked_placement(req.placement, batch, ranks) if req.placement is not None
                 else placement(self.placement_kind, batch, ranks))
        return _Call(req.id, req.mode, req.seed, req.data.shape, "float32", where), req.data

    def forward(self, data: Any, call: _Call) -> Local:
        return self.driver.forward(data, call.mode, call.seed)

    def respond(self, out: BinaryIO, call: _Call, gathered: list[Any], seqs: list[list[int]]) -> None:
        from . import adapter

        (experts, weights, kept), capacity, rows = _assemble(gathered, seqs, call.shape[0], call.shape[1])
        cols = adapter.routes_from_arrays(experts, weights, kept).columns()
        v2.write_response(out, call.id, cols, capacity, self.driver.experts, call.placement, rows)


class _Model:
    """``moe-audit/3``: a whole model on token ids. Its sequences are placed contiguously (rank r
    holds the r-th slice of the batch), so a rank's capacity is stated as the group of its
    consecutive tokens (``tokens:N`` over the sequence-major order, N = its tokens)."""

    def __init__(self, driver: ModelDriver) -> None:
        self.driver = driver

    def handshake(self, ranks: int, weights: str | None) -> dict[str, Any]:
        from .hf import wire3

        d = self.driver
        return wire3.handshake(d.name, d.vocab, d.layers, d.outputs, logits=False, padding_mask=False,
                               generate=False)

    def read(self, inp: BinaryIO, ranks: int) -> tuple[_Call, np.ndarray] | None:
        from .hf import wire3

        req = wire3.read_request(inp, self.driver.vocab)
        if req is None:
            return None
        if req.padding is not None or req.path != "forward":
            raise ValueError(f"request {req.id}: the model offers neither a padding mask nor the generation path")
        where = placement("contiguous", req.ids.shape[0], ranks)
        return _Call(req.id, req.mode, req.seed, req.ids.shape, "int64", where), req.ids

    def forward(self, ids: Any, call: _Call) -> tuple[list[Local], np.ndarray | None]:
        return self.driver.forward(ids, call.mode, call.seed)

    def respond(self, out: BinaryIO, call: _Call, gathered: list[Any], seqs: list[list[int]]) -> None:
        from .hf import wire3
        from .hf.routers import Decoded

        batch, seq_len = call.shape
        routed = [layer for layer in self.driver.layers if layer["kind"] != "dense"]
        layers = []
        for i, layer in enumerate(routed):
            (experts, weights, kept), capacity, _ = _assemble([g[0][i] for g in gathered], seqs, batch, seq_len)
            if capacity is not None:
                per = len(seqs[0]) * seq_len
                capacity = {"scope": f"tokens:{per}", "slots": capacity["slots"], "flatten": "sequence-major"}
            decoded = Decoded(experts.astype(np.int32), weights.astype(np.float32), kept, None, capacity)
            layers.append((layer["layer"], (decoded, layer["experts"])))
        rows: np.ndarray | None = None
        if self.driver.outputs:
            placed = np.zeros((batch, seq_len, self.driver.outputs), dtype=np.float32)
            for (_, local_rows), mine in zip(gathered, seqs):
                placed[mine] = np.asarray(local_rows).reshape(len(mine), seq_len, -1)
            rows = placed.reshape(batch * seq_len, -1)
        header, payload = wire3.response(call.id, layers, rows, False)
        out.write(header)
        out.write(payload)


_Conversation = Union[_Layer, _Model]
_progress: _Progress | None = None


def _serve(conversation: _Conversation, fingerprint: Callable[[], str | None]) -> None:
    """The loop every rank runs (see the module doc)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("moe_audit.distributed: torch.distributed is not initialised; launch with "
                           "python -m torch.distributed.run and call init_process_group first")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    _protect_stdout()
    global _progress
    progress = _progress = _Progress(rank, ranks, _limit())
    weights = fingerprint()
    inp, out = sys.stdin.buffer, protocol_stdout()
    if rank == 0:
        out.write(json.dumps(conversation.handshake(ranks, weights)).encode() + b"\n")
        out.flush()
    clock = _Clock()
    number = 0
    while True:
        number += 1
        header: list[Any] = [None]
        data = None
        if rank == 0:
            with clock("waiting"):
                read = conversation.read(inp, ranks)
            if read is not None:
                header[0], array = read
                data = torch.from_numpy(array.copy())
        with clock("collectives"):
            dist.broadcast_object_list(header, src=0)
        call: _Call | None = header[0]
        if call is None:
            # Every rank leaves together and closes its groups: a rank exiting while another
            # still tears gloo down can abort it (seen with DeepSpeed's dropless all-reduce).
            dist.barrier()
            dist.destroy_process_group()
            return
        progress.mark(number, "received")
        if data is None:
            data = torch.empty(call.shape, dtype=getattr(torch, call.dtype))
        seqs = call.sequences(ranks)
        with clock("collectives"):
            dist.broadcast(data, src=0)
        with clock("forwards"):
            local = conversation.forward(data[seqs[rank]], call)
        progress.mark(number, "done")
        gathered: list[Any] = [None] * ranks if rank == 0 else []
        with clock("collectives"):
            dist.gather_object(local, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            with clock("answering"):
                conversation.respond(out, call, gathered, seqs)
                out.flush()
            progress.mark(number, "answered")
            clock.save(number)


class _Clock:
    """Where rank 0's time goes, per kind (waiting for moe-audit, collectives, the layer's
    forwards, encoding answers); rewritten as JSON after every call to the file
    ``MOE_AUDIT_TIMINGS`` names, if any (moe-audit ends the launch without waiting; BENCHMARKS.md:
    how a distributed audit's time splits)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.spent: dict[str, float] = {}
        self.path = os.environ.get("MOE_AUDIT_TIMINGS")

    @contextlib.contextmanager
    def __call__(self, kind: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.spent[kind] = self.spent.get(kind, 0.0) + time.monotonic() - start

    def save(self, calls: int) -> None:
        if not self.path:
            return
        figures = {"calls": calls, "serving_s": round(time.monotonic() - self.started, 3),
                   **{f"{k}_s": round(v, 3) for k, v in sorted(self.spent.items())}}
        with open(f"{self.path}.partial", "w") as f:
            json.dump(figures, f)
        os.replace(f"{self.path}.partial", self.path)


def serve(driver: Driver, placement_kind: str = "contiguous") -> None:
    """Serves a layer on every rank until moe-audit closes rank 0's stdin (see the module doc),
    then destroys the process groups. Call it on every rank, after the groups and the layer are built."""
    placement(placement_kind, 1, 1)  # the kind, checked before anything runs
    _serve(_Layer(driver, placement_kind), driver.fingerprint)


def serve_model(driver: ModelDriver) -> None:
    """As :func:`serve`, for a whole model on token ids (``moe-audit model --model-cmd``)."""
    _serve(_Model(driver), driver.fingerprint)


def _one_line_on_failure(serving: Callable[[], None]) -> None:
    """Runs serving; a failure on this rank is written as its one fault line, then exit 1 (the
    launcher ends the other ranks)."""
    try:
        serving()
    except Exception as e:  # the traceback for the user, then the one line moe-audit quotes
        traceback.print_exc()
        problem = f"{type(e).__name__}: {e}"
        fault(_rank_label(), problem if _progress is None else _progress.failed(problem))
        sys.stderr.flush()
        os._exit(1)


def run_driver(driver: Driver, placement_kind: str = "contiguous") -> None:
    """:func:`serve`, a failure on this rank ending the launch with its one fault line."""
    _one_line_on_failure(lambda: serve(driver, placement_kind))


def run_model_driver(driver: ModelDriver) -> None:
    """:func:`serve_model`, a failure on this rank ending the launch with its one fault line."""
    _one_line_on_failure(lambda: serve_model(driver))


__all__ = ["FAULT", "PLACEMENTS", "Driver", "Local", "ModelDriver", "experts_fingerprint", "fault", "fingerprint_of",
           "placement", "run_driver", "run_model_driver", "seed_experts", "serve", "serve_model"]

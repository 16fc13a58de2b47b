"""Audit a Megatron-Core MoE router (``TopKRouter``) on hidden states (``moe-audit/2``), on the CPU.

::

    from megatron.core.transformer.transformer_config import TransformerConfig
    import moe_audit.megatron

    moe_audit.megatron.run(TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
        num_moe_experts=8, moe_router_topk=2, moe_expert_capacity_factor=1.0))

serves the router to ``moe-audit check --router-cmd "python3 this_file.py"``;
``moe_audit.check(moe_audit.megatron.wrap(config), probes="P,F")`` audits it from this
process. ``wrap`` takes a ``TransformerConfig`` (a ``TopKRouter`` is built from it with no process
group, its gate initialised by the config's own ``init_method`` from torch seeded with ``seed``), a
``TopKRouter``, or a module holding one (an ``MoELayer``, a ``GPTModel``: the router at ``path``,
e.g. ``"decoder.layers.1.mlp.router"``, default the first).

Per call the router is called as ``MoELayer.route`` calls it (``router(hidden_states,
padding_mask)``), under ``torch.no_grad()``:

- the hidden states ``[batch, seq_len, hidden]`` go in as Megatron's ``[seq_len, batch, hidden]``
  (the router flattens tokens position-major, row ``s * batch + b``: who is "earlier" for a
  capacity), and the routes come back in moe-audit's order, ``b * seq_len + s``;
- the padding mask goes in as Megatron's ``padding_mask`` ``[seq_len, batch]``, True = padding
  (Megatron masks only the aux losses and the expert-bias counts with it: padding tokens are
  routed and take capacity; quantile balancing, new in 0.19, refuses a mask and gets none);
- ``.train()``/``.eval()`` from the mode (Sinkhorn balances only in training);
- the routes are recovered from what Megatron returns, sparse probs and a bool map ``[tokens,
  experts]`` with no choice order: the top-k before dropping (caught as it enters
  ``apply_router_token_dropping``) ordered by probability (descending, ties to the lower expert
  id), each kept if the map after dropping has it, with its combine weight (kept) or its
  probability before dropping (dropped: Megatron does not renormalise), and the capacity Megatron
  computed for the call (``get_capacity``; None when dropless). Rows added by
  ``moe_pad_expert_input_to_capacity`` (prob 0, not a token's choice) are not routes.

Gradients change nothing the audit compares: with them Megatron adds aux losses (same values
forward), counts tokens for the expert bias (moved between steps, not in the call) and reaches its
process groups, which are None here. No CUDA is needed: Megatron puts the gate and expert-bias
buffers on ``torch.cuda.current_device()``, which answers ``device`` while Megatron runs (default:
CUDA when available, else the CPU). ``seed_calls=True`` keys the input jitter's draws per token
(:mod:`moe_audit.hf.seeded`). Needs torch and megatron-core (0.16 and 0.19 lines); file:line
references below are megatron-core 0.16.1's ``megatron/core/transformer/moe/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import numpy as np
import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe import router as router_module
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from . import adapter, distributed
from ._wire import v1, v2
from .hf.seeded import PerToken

# Without Transformer Engine, megatron-core 0.16.1 never defines `te_general_gemm` (moe_utils.py:22-39)
# but its gate reads it (moe_utils.py:1192): a NameError on every call, on a GPU too. None is what
# it means there.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


class _NoStream:
    """A CUDA stream's methods Megatron calls, doing nothing: on the CPU every op is in order."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        return self

    def synchronize(self) -> None:
        pass


def cpu_workarounds() -> None:
    """What megatron-core (0.16.1 lines cited) needs to run an MoE layer or a GPTModel on a
    machine without CUDA, each found by running it there; applied on import when CUDA is not
    available, never on a GPU machine:

    - ``torch.cuda.current_device()`` answers the CPU: Megatron allocates on it, first when the
      router moves its weight "to the GPU" on every forward (``transformer/moe/router.py:88-92``),
      then in the all-gather/all-to-all buffers (``tensor_parallel/mappings.py:91,141``);
    - ``torch.cuda.Stream``/``current_stream``/``stream`` do nothing: the alltoall dispatcher makes
      a stream in its constructor (``transformer/moe/token_dispatcher.py:445``) and moves its splits
      to the host on it (``:862-899``);
    - the model-parallel RNG tracker uses torch's CPU generator: ``model_parallel_cuda_manual_seed``
      reads ``torch.cuda.get_rng_state()`` (``tensor_parallel/random.py:235-240``) and the tracker's
      ``fork()`` (a GPTModel's attention, ``:250`` through ``:55``) ``torch.cuda.random``'s, which ask
      for a driver;
    - the alltoall dispatcher's split sizes become numpy arrays on the CPU too:
      ``maybe_move_tensor_to_cpu`` converts only CUDA tensors (``transformer/moe/moe_utils.py:1093``),
      and gloo's ``all_to_all_single`` refuses tensors as split sizes;
    - a GPTModel's default causal mask is made on the CPU (``transformer/utils.py:35`` makes it on
      ``"cuda"``; ``fusions/fused_softmax.py:327`` uses it when no mask is given).
    """
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import token_dispatcher

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu  # type: ignore[assignment,return-value]  # used as `device=`
    torch.cuda.Stream = lambda *a, **k: _NoStream()  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state  # the tracker's fork(), random.py:55, :250
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    to_host = token_dispatcher.maybe_move_tensor_to_cpu
    if not getattr(to_host, "moe_audit", False):
        def host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                return tensor.numpy()
            return to_host(tensor, as_numpy, record_stream)

        host.moe_audit = True  # type: ignore[attr-defined]
        token_dispatcher.maybe_move_tensor_to_cpu = host
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()


if not torch.cuda.is_available():
    cpu_workarounds()


def _no_groups() -> Any:
    """Process groups all None: the forward only reaches them with gradients (aux losses, z-loss)."""
    return ProcessGroupCollection(**{f.name: None for f in dataclasses.fields(ProcessGroupCollection)})


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """While Megatron runs, ``torch.cuda.current_device()`` answers device: its gate moves there
    in ``gating()`` (router.py:88-92) and its expert-bias buffers are made there (router.py:162-183),
    which fails on a machine without CUDA."""
    if device.type == "cuda":
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: device  # type: ignore[assignment,return-value]  # as Megatron reads it
    try:
        yield
    finally:
        torch.cuda.current_device = saved


@contextlib.contextmanager
def _dropping(where: Callable[[], dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Records the top-k before capacity dropping and the capacity Megatron computes: the router
    calls ``apply_router_token_dropping`` after top-k (router.py:586-595), which calls
    ``get_capacity`` (moe_utils.py:832-836). Each goes into ``where()`` (the router running now),
    else into the dict yielded."""
    seen: dict[str, Any] = {}
    drop, capacity = router_module.apply_router_token_dropping, moe_utils.get_capacity

    def dropping(probs: torch.Tensor, routing_map: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        (where() if where else seen)["before"] = (probs, routing_map)
        return drop(probs, routing_map, *args, **kwargs)

    def get_capacity(*args: Any, **kwargs: Any) -> Any:
        slots = capacity(*args, **kwargs)
        (where() if where else seen)["capacity"] = slots
        return slots

    router_module.apply_router_token_dropping, moe_utils.get_capacity = dropping, get_capacity
    try:
        yield seen
    finally:
        router_module.apply_router_token_dropping, moe_utils.get_capacity = drop, capacity


@contextlib.contextmanager
def _capture(routers: Sequence[Any]) -> Iterator[list[dict[str, Any]]]:
    """Per router, in order, what one forward of the layer or model routed with it: its outputs
    (``probs``, ``map``), its top-k before dropping and its capacity (see :func:`_dropping`)."""
    seen: list[dict[str, Any]] = [{} for _ in routers]
    running = [0]
    hooks = []
    for i, router in enumerate(routers):
        hooks.append(router.register_forward_pre_hook(lambda _m, _a, i=i: running.__setitem__(0, i)))
        hooks.append(router.register_forward_hook(
            lambda _m, _a, out, i=i: seen[i].update(probs=out[0], map=out[1])))
    try:
        with _dropping(lambda: seen[running[0]]):
            yield seen
    finally:
        for hook in hooks:
            hook.remove()


def _local(seen: dict[str, Any], batch: int, seq_len: int, output: np.ndarray | None) -> distributed.Local:
    """One router's capture (:func:`_capture`) as a rank's answer, in moe-audit's order."""
    experts, weights, kept = (_sequence_major(a, seq_len, batch)
                              for a in decode(seen["probs"], seen["map"], seen.get("before")))
    return distributed.Local(experts, weights, kept, seen.get("capacity"), output)


def build(config: TransformerConfig, seed: int = 0, device: torch.device | str | None = None) -> Any:
    """A ``TopKRouter`` of config on device (default: CUDA when available, else the CPU), with no
    process group; its gate is initialised by the config's ``init_method`` from torch seeded with seed."""
    device = _device(device)
    torch.manual_seed(seed)
    with on_device(device):
        return TopKRouter(config, pg_collection=_no_groups()).to(device)


def _device(device: torch.device | str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def find_router(module: torch.nn.Module, path: str | None = None) -> tuple[str, Any]:
    """(path, router) of the ``TopKRouter`` at path in module, or of the first one (module itself
    included)."""
    routers = [(p, m) for p, m in module.named_modules() if isinstance(m, TopKRouter)]
    if not routers:
        raise TypeError(f"moe_audit.megatron: no TopKRouter in {type(module).__name__}; give a TransformerConfig, "
                        "a TopKRouter, or a module holding one (an MoELayer, a GPTModel)")
    if path is None:
        return routers[0]
    for found in routers:
        if found[0] == path:
            return found
    raise ValueError(f"moe_audit.megatron: no TopKRouter at {path!r} in {type(module).__name__}; its routers: "
                     f"{', '.join(repr(p) for p, _ in routers)}")


def _name(config: TransformerConfig, k: int) -> str:
    """A short name saying what the router does: megatron-top2-sigmoid-cf1-probs (softmax unsaid)."""
    parts = [f"megatron-top{k}"]
    if config.moe_router_score_function != "softmax":
        parts.append(config.moe_router_score_function)
    if config.moe_router_load_balancing_type in ("sinkhorn", "quantile_balancing"):
        parts.append(config.moe_router_load_balancing_type.replace("_", "-"))
    if config.moe_expert_capacity_factor is not None:
        parts += [f"cf{config.moe_expert_capacity_factor:g}", config.moe_token_drop_policy]
        if config.moe_pad_expert_input_to_capacity:
            parts.append("pad")
    return "-".join(parts)


def decode(probs: torch.Tensor, routing_map: torch.Tensor,
           before: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(experts, weights, kept) ``[tokens, k]`` in Megatron's token order, of the router's
    outputs (``probs`` and ``routing_map`` ``[tokens, experts]``) and ``before`` = (probs, map)
    before capacity dropping (None: nothing was dropped)."""
    final_probs = probs.detach().double().cpu().numpy()
    final_map = routing_map.detach().bool().cpu().numpy()
    chosen_probs, chosen = (final_probs, final_map) if before is None else (
        before[0].detach().double().cpu().numpy(), before[1].detach().bool().cpu().numpy())
    counts = chosen.sum(axis=1)
    if (counts != counts[0]).any():
        t = int(np.argmax(counts != counts[0]))
        raise RuntimeError(f"moe_audit.megatron: the router chose {counts[t]} experts for token row {t} and "
                           f"{counts[0]} for row 0; expected its top-k for every token")
    k = int(counts[0])
    # The map has no choice order: by probability, descending, ties to the lower expert id.
    score = np.where(chosen, chosen_probs, -np.inf)
    ids = np.broadcast_to(np.arange(score.shape[1]), score.shape)
    experts = np.lexsort((ids, -score), axis=-1)[:, :k]
    kept = np.take_along_axis(final_map, experts, axis=1)
    weights = np.where(kept, np.take_along_axis(final_probs, experts, axis=1),
                       np.take_along_axis(chosen_probs, experts, axis=1))
    return experts, weights, kept


def _sequence_major(a: np.ndarray, seq_len: int, batch: int) -> np.ndarray:
    """Rows in Megatron's order (s * batch + b) -> moe-audit's (b * seq_len + s)."""
    rows: np.ndarray = a.reshape(seq_len, batch, -1).transpose(1, 0, 2).reshape(seq_len * batch, -1)
    return rows


class Router:
    """A wrapped Megatron-Core ``TopKRouter``: ``route(data, mode, seed, padding)`` and the
    handshake attributes (``name``, ``experts``, ``top_k``, ``input``, ``hidden_size``,
    ``protocol``, ``padding_mask``) that ``moe_audit.run``, ``moe_audit.check`` and the snapshot
    helper read."""

    input = "hidden"

    def __init__(self, router_or_config: TransformerConfig | torch.nn.Module, *, path: str | None = None,
                 seed: int = 0, name: str | None = None, device: torch.device | str | None = None,
                 seed_calls: bool = False, protocol: adapter.Protocol = v2.PROTOCOL) -> None:
        self.device = _device(device)
        if isinstance(router_or_config, TransformerConfig):
            self.path, self.router = "", build(router_or_config, seed, self.device)
        elif isinstance(router_or_config, torch.nn.Module):
            self.path, self.router = find_router(router_or_config, path)
            self.router.to(self.device)
        else:
            raise TypeError(f"moe_audit.megatron: got a {type(router_or_config).__name__}; give a TransformerConfig, "
                            "a TopKRouter, or a module holding one")
        config = self.router.config
        self.experts = int(config.num_moe_experts)
        self.top_k = int(self.router.topk)
        self.hidden_size = int(self.router.weight.shape[1])
        self.protocol = adapter.protocol_name(protocol)
        # Quantile balancing (0.19) refuses a padding mask (NVIDIA/Megatron-LM core_v0.19.0
        # router.py:768-771, as PyPI's 0.19.2 ships it).
        self.padding_mask = (self.protocol != v1.PROTOCOL
                             and config.moe_router_load_balancing_type != "quantile_balancing")
        self.seed_calls = seed_calls
        self.name = name or _name(config, self.top_k)
        torch.manual_seed(seed)

    def __repr__(self) -> str:
        where = f" at {self.path}" if self.path else ""
        return (f"moe_audit.megatron.Router({self.name}{where}: {self.experts} experts, top {self.top_k}, "
                f"hidden {self.hidden_size}, {self.device})")

    @torch.no_grad()
    def route(self, data: Any, mode: str, seed: int | None = None,
              padding: Any = None) -> tuple[adapter.Routes, adapter.Capacity]:
        """Routes data [batch, seq_len, hidden] (float32) in mode "train" or "inference"."""
        batch, seq_len = np.shape(data)[:2]
        self.router.train(mode == "train")
        rows = np.ascontiguousarray(np.asarray(data, dtype=np.float32).transpose(1, 0, 2))  # [S, B, H]
        x = torch.from_numpy(rows).to(self.device, self.router.weight.dtype)
        kwargs: dict[str, torch.Tensor] = {}
        if padding is not None and self.padding_mask:
            kwargs["padding_mask"] = torch.from_numpy(np.asarray(padding, dtype=bool).T.copy()).to(self.device)
        # Jitter is drawn on [S, B, H]: keyed by the rows in that layout (a token's key is its row).
        seeded = PerToken(seed, rows) if self.seed_calls and seed is not None else contextlib.nullcontext()
        with on_device(self.device), _dropping() as seen, seeded:
            probs, routing_map = self.router(x, **kwargs)
        experts, weights, kept = (_sequence_major(a, seq_len, batch)
                                  for a in decode(probs, routing_map, seen.get("before")))
        return adapter.routes_from_arrays(experts, weights, kept), seen.get("capacity")

    def run(self, argv: Sequence[str] | None = None) -> None:
        """Serves the router on stdin/stdout (``moe-audit check --router-cmd``), or with
        ``--answer-plan DIR`` answers a trace plan."""
        adapter.run(self.route, self.name, self.experts, self.top_k, self.input, self.hidden_size,
                    argv=argv, protocol=self.protocol, padding_mask=self.padding_mask,
                    seed_calls=self.seed_calls)


class Layer:
    """A Megatron-Core ``MoELayer`` as built by the user's script, run on this rank's sequences
    over its expert-parallel group (a :class:`moe_audit.distributed.Driver`).

    Per call, under ``torch.no_grad()``: the rank's ``[b_local, seq_len, hidden]`` rows go in as
    Megatron's ``[seq_len, b_local, hidden]`` (the layer flattens tokens position-major: who is
    "earlier" for a capacity), ``.train()``/``.eval()`` from the mode; the routes are read from
    the router's outputs as :class:`Router` reads them (top-k before dropping, kept after, the
    capacity ``get_capacity`` computed: over this rank's tokens, ``router.py:587-595``), the output
    rows from the layer's output (``MoELayer.forward`` returns ``(output, mlp_bias)``), both
    returned in moe-audit's order (``b * seq_len + s``).
    """

    def __init__(self, layer: torch.nn.Module, *, name: str | None = None, seed_calls: bool = False) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        if not isinstance(layer, MoELayer):
            raise TypeError(f"moe_audit.megatron: expected an MoELayer, got {type(layer).__name__}")
        self.layer = layer
        self.router = layer.router
        config = self.router.config
        self.experts = int(config.num_moe_experts)
        self.top_k = int(self.router.topk)
        self.hidden_size = int(self.router.weight.shape[1])
        self.dtype = next(p.dtype for p in layer.experts.parameters())
        self.output_dtype = str(self.dtype).removeprefix("torch.")
        self.seed_calls = seed_calls
        ep = int(config.expert_model_parallel_size)
        self.name = name or f"{_name(config, self.top_k)}-{config.moe_token_dispatcher_type}-ep{ep}"

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, mode: str, seed: int | None) -> distributed.Local:
        batch, seq_len = hidden.shape[:2]
        self.layer.train(mode == "train")
        x = hidden.transpose(0, 1).contiguous().to(self.router.weight.device, self.dtype)  # [S, b, H]
        # Jitter is drawn on [S, b, H]: keyed by the rows in that layout (a copy made only when asked).
        seeded: Any = (PerToken(seed, x.float().cpu().numpy()) if self.seed_calls and seed is not None
                       else contextlib.nullcontext())
        with _capture([self.router]) as seen, seeded:
            output, _ = self.layer(x)
        out = output.detach().float().cpu().numpy().transpose(1, 0, 2).reshape(batch * seq_len, -1)
        return _local(seen[0], batch, seq_len, np.ascontiguousarray(out, dtype=np.float32))

    def fingerprint(self) -> str | None:
        """The router's weight and every expert's parameters in global expert order, gathered over
        the expert-parallel group (a SequentialMLP: local expert i of EP rank r is global expert
        r * local + i); None for other expert modules, whose layout changes with the EP size."""
        from megatron.core import parallel_state

        return distributed.experts_fingerprint(self.router.weight, getattr(self.layer.experts, "local_experts", None),
                                               parallel_state.get_expert_model_parallel_group())


def seed_experts(layer: Any, seed: int = 0, std: float = 0.02) -> None:
    """Sets an MoELayer's router weight and every expert's parameters from ``seed``, each expert's
    from a generator keyed by its global id, so the same script builds the same layer at any
    expert-parallel size (Megatron's own init does not: with ``use_cpu_initialization`` local
    expert i has the same weights on every EP rank, so EP 2 has four distinct experts where EP 1
    has eight; on a GPU they are seeded by EP rank, ``tensor_parallel/random.py:428``)."""
    from megatron.core import parallel_state

    local = getattr(layer.experts, "local_experts", None)
    if local is None:
        raise TypeError("moe_audit.megatron.seed_experts: needs SequentialMLP experts (local_experts)")
    first = parallel_state.get_expert_model_parallel_rank() * len(local)
    distributed.seed_experts(layer.router.weight, local, first, seed, std)


def run_layer(layer: torch.nn.Module, placement: str = "contiguous", **options: Any) -> None:
    """Serves an MoELayer built on this rank to moe-audit across the launch's ranks (every rank
    calls it; see :mod:`moe_audit.distributed`); options: ``name``, ``seed_calls``."""
    distributed.run_driver(Layer(layer, **options), placement)


class Model:
    """A Megatron-Core ``GPTModel`` as built by the user's script, run on this rank's sequences
    of token ids (a :class:`moe_audit.distributed.ModelDriver`, ``moe-audit/3``).

    Per call, under ``torch.no_grad()``: ``model(ids, position_ids, attention_mask=None)`` (the
    default causal mask; positions 0..seq_len-1), ``.train()``/``.eval()`` from the mode; every
    MoE layer's routes read from its router as :class:`Layer` reads them; the output rows are the
    log-probabilities of the logits (width: the vocabulary). One pipeline stage only (the model
    holds the embedding and the output layer); packed sequences (THD) need Transformer Engine
    (``transformer/dot_product_attention.py:153`` asserts without it) and are not used.
    """

    def __init__(self, model: Any, *, name: str | None = None) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        if not (getattr(model, "pre_process", False) and getattr(model, "post_process", False)):
            raise TypeError(f"moe_audit.megatron: expected a GPTModel holding its embedding and output layer (one "
                            f"pipeline stage), got {type(model).__name__}")
        self.model = model
        self.layers: list[dict[str, Any]] = []
        self.routers = []
        for layer in model.decoder.layers:
            number = int(layer.layer_number) - 1  # Megatron counts from 1
            if isinstance(layer.mlp, MoELayer):
                router = layer.mlp.router
                self.routers.append(router)
                self.layers.append({"layer": number, "kind": "moe", "experts": int(router.config.num_moe_experts),
                                    "top_k": int(router.topk)})
            else:
                self.layers.append({"layer": number, "kind": "dense"})
        if not self.routers:
            raise TypeError("moe_audit.megatron: the model has no MoE layer")
        self.vocab = int(model.vocab_size)
        self.outputs = self.vocab
        config = self.routers[0].config
        routing = _name(config, int(self.routers[0].topk)).removeprefix("megatron-")
        self.name = name or f"megatron-gpt{len(self.layers)}-{routing}-ep{config.expert_model_parallel_size}"

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, mode: str, seed: int | None) -> tuple[list[distributed.Local], np.ndarray]:
        batch, seq_len = ids.shape
        self.model.train(mode == "train")
        device = self.routers[0].weight.device
        ids = ids.to(device)
        positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
        with _capture(self.routers) as seen:
            logits = self.model(ids, positions, None)
        rows = torch.log_softmax(logits.float(), dim=-1).cpu().numpy().reshape(batch * seq_len, -1)
        return [_local(one, batch, seq_len, None) for one in seen], np.ascontiguousarray(rows, dtype=np.float32)

    def fingerprint(self) -> str | None:
        """None: a model audit compares no launches."""
        return None


def wrap(router_or_config: TransformerConfig | torch.nn.Module, **options: Any) -> Router:
    """A :class:`Router` of a ``TransformerConfig``, a ``TopKRouter`` or a module holding one;
    options: ``path`` (which router of a model: its module path, default the first), ``seed``,
    ``name``, ``device``, ``seed_calls``, ``protocol``."""
    return Router(router_or_config, **options)


def run(router_or_config: TransformerConfig | torch.nn.Module, argv: Sequence[str] | None = None,
        **options: Any) -> None:
    """Serves to moe-audit: in a process launched by ``torch.distributed.run`` (``RANK`` set), an
    ``MoELayer`` as a layer across the launch's ranks (``check --router-cmd``; :func:`run_layer`,
    options ``placement``, ``name``, ``seed_calls``) and a ``GPTModel`` as a whole model on token
    ids (``model --model-cmd``; :class:`Model`, option ``name``); anything else as a router
    (``wrap(router_or_config, **options).run(argv)``, ``check --router-cmd``)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if isinstance(router_or_config, MoELayer) and "RANK" in os.environ:
        run_layer(router_or_config, **options)
    elif isinstance(router_or_config, GPTModel) and "RANK" in os.environ:
        distributed.run_model_driver(Model(router_or_config, **options))
    else:
        wrap(router_or_config, **options).run(argv)


__all__ = ["Layer", "Model", "Router", "build", "cpu_workarounds", "decode", "find_router", "run", "run_layer",
           "seed_experts", "wrap"]

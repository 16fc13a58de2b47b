"""Audit a DeepSpeed MoE gate as shipped: ``deepspeed.moe.sharded_moe.TopKGate``, or the gate of a
``deepspeed.moe.layer.MoE`` or ``MOELayer``, on hidden states (``moe-audit/2``).

::

    import torch, moe_audit.deepspeed                  # before deepspeed: its log goes to stderr
    from deepspeed.moe.sharded_moe import TopKGate

    torch.manual_seed(0)
    moe_audit.deepspeed.run(TopKGate(64, 8, k=2, capacity_factor=1.0))

serves the gate to ``moe-audit check --router-cmd "python3 this_file.py"``;
``moe_audit.check(moe_audit.deepspeed.wrap(gate), probes="P,F")`` audits it from this process.

Each call routes the request's hidden states as ``MOELayer.forward`` does (deepspeed 0.19.8,
``deepspeed/moe/sharded_moe.py:660-663``): the ``[batch, seq_len, hidden]`` rows flattened
sequence-major to ``[batch * seq_len, hidden]`` and given to the gate with ``sparse_routes=True``,
after ``.train()`` or ``.eval()`` from the request's mode. So everything the gate does is audited:
the capacity over the call (``_capacity``: ``ceil(T / E * capacity_factor * k)``, at least
``min_capacity``), ``eval_capacity_factor`` in eval, ``drop_tokens``, random token selection
(``use_rts``), top-2's sampled second expert, the noisy gate policies (``Jitter``, ``RSample``,
training only) and top-k > 2 (``TopKGate`` always drops by the ``probs`` policy).

DeepSpeed returns nothing for a dropped route (expert -1, gate 0). The adapter routes the call
twice with the same random draws: once with ``drop_tokens=False`` (the choices and gates before
any drop; the global generator is restored after it), then as configured (the kept routes and
their gates, renormalised over the survivors as DeepSpeed combines them). A dropped route is
reported with its expert and the gate it had before dropping, and the capacity in force is
DeepSpeed's slot count for the whole call (``None`` with ``drop_tokens=False``: its capacity is
then the largest expert count, a buffer size that never drops a route).

``min_capacity`` larger than a call's tokens: top-1 asserts (``sharded_moe.py:278``, also with
``drop_tokens=False``) while top-2 and top-k route such a call with a capacity of at least every
token, so nothing drops. Training never sees such a call with a fitting micro-batch, but the
audit's prefixes are short. The adapter routes it as top-2 and top-k do: ``min_capacity`` is
lowered to the call's tokens for that call only (top-1 already bounds its selection by the tokens,
``sharded_moe.py:283``, so the routing is the one DeepSpeed would compute without the assert) and
the capacity reported is DeepSpeed's, ``max(ceil(T / E * cf), min_capacity)``.

Random draws (RTS, Gumbel sampling, RSample, Jitter) come from torch's global generator, seeded
once with ``seed`` by :func:`wrap`: a random gate draws fresh noise on every call, which the D
probe reports. ``seed_calls=True`` keys every draw of a call per token on the request's seed and
the token's own row (:mod:`moe_audit.hf.seeded`), so the same call draws the same noise and the
other probes see the gate's own dependence on other tokens. Needs torch and deepspeed
(``DS_BUILD_OPS=0 pip install deepspeed``; ``DS_ACCELERATOR=cpu`` on a machine without a GPU).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Callable

import numpy as np
import torch

from . import adapter, distributed
from ._wire import v2
from .hf.seeded import PerToken

# Without a GPU DeepSpeed must be told to use its CPU accelerator before it is imported
# (deepspeed/accelerator/real_accelerator.py reads DS_ACCELERATOR).
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed logs to stdout (deepspeed/utils/logging.py:45), where the protocol is spoken: a
# logger created during this import writes to stderr, one created before is pointed there.
with contextlib.redirect_stdout(sys.stderr):
    from deepspeed.moe.sharded_moe import TopKGate
for _handler in logging.getLogger("DeepSpeed").handlers:
    if isinstance(_handler, logging.StreamHandler) and _handler.stream is sys.stdout:
        _handler.setStream(sys.stderr)
if os.environ.get("DS_ACCELERATOR") == "cpu":
    # On the CPU accelerator `deepspeed.init_distributed` JIT-builds a shared-memory allreduce op
    # with ninja (deepspeed 0.19.8 comm/torch.py:47-53, called at :207): a compiler run of about a
    # minute, or an error when ninja is not on the PATH. An optimisation of all-reduce only:
    # collectives go through gloo without it.
    _comm: Any = importlib.import_module("deepspeed.comm.torch")
    _comm.build_shm_op = lambda: None


def find_gate(module: torch.nn.Module) -> Any:
    """The ``TopKGate`` of a gate, an ``MOELayer`` (``.gate``) or a ``deepspeed.moe.layer.MoE``
    (``.deepspeed_moe.gate``)."""
    layer = getattr(module, "deepspeed_moe", module)
    gate = module if isinstance(module, TopKGate) else getattr(layer, "gate", None)
    if not isinstance(gate, TopKGate):
        raise TypeError(f"moe_audit.deepspeed: expected a deepspeed TopKGate, MOELayer or MoE, got "
                        f"{type(module).__name__}")
    return gate


@contextlib.contextmanager
def _set(gate: torch.nn.Module, **attributes: Any) -> Iterator[None]:
    """The gate's attributes set for one call, restored after."""
    saved = {name: getattr(gate, name) for name in attributes}
    for name, value in attributes.items():
        setattr(gate, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gate, name, value)


class Gate:
    """A wrapped DeepSpeed gate: ``route(data, mode, seed)`` and the handshake attributes
    (``name``, ``experts``, ``top_k``, ``input``, ``hidden_size``, ``protocol``) that
    ``moe_audit.run``, ``moe_audit.check`` and the snapshot helper read."""

    input = "hidden"
    padding_mask = False

    def __init__(self, module: torch.nn.Module, *, seed: int = 0, name: str | None = None,
                 protocol: adapter.Protocol = v2.PROTOCOL, seed_calls: bool = False) -> None:
        self.module = module
        self.gate = find_gate(module)
        self.experts = int(self.gate.wg.out_features)
        self.hidden_size = int(self.gate.wg.in_features)
        self.top_k = int(self.gate.k)
        self.protocol = adapter.protocol_name(protocol)
        self.seed_calls = seed_calls
        self.name = name or f"deepspeed-top{self.top_k}"
        torch.manual_seed(seed)

    def __repr__(self) -> str:
        g = self.gate
        return (f"moe_audit.deepspeed.Gate({self.experts} experts, top {self.top_k}, hidden {self.hidden_size}, "
                f"capacity_factor {g.capacity_factor}, eval {g.eval_capacity_factor}, min_capacity "
                f"{g.min_capacity}, drop_tokens {g.drop_tokens}, use_rts {g.use_rts}, noisy {g.noisy_gate_policy})")

    def _gate(self, x: torch.Tensor, draws: Callable[[], AbstractContextManager[Any]],
              **attributes: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(experts [T, k], gates [T, k], capacity) of one gate call made as MOELayer makes it
        (sharded_moe.py:662), with the gate's attributes set for the call."""
        # ep_group None: the audit routes one rank's call; a group would only make the dropless
        # capacity a maximum over ranks (sharded_moe.py:251), and hang without the other ranks.
        with _set(self.gate, ep_group=None, **attributes), draws():
            _, capacity, _, experts, _, gates, _ = self.gate(x, None, True, False)
        return experts.t().long().cpu(), gates.t().double().cpu(), int(capacity)

    @torch.no_grad()
    def route(self, data: Any, mode: str, seed: int | None = None) -> tuple[adapter.Routes, adapter.Capacity]:
        """Routes data [batch, seq_len, hidden] (float32) in mode "train" or "inference"; with
        ``seed_calls`` and the request's seed, every random draw is keyed per token."""
        self.module.train(mode == "train")
        g = self.gate
        weight = g.wg.weight
        x = torch.tensor(np.asarray(data), dtype=weight.dtype, device=weight.device).reshape(-1, self.hidden_size)
        tokens = x.shape[0]

        def draws() -> AbstractContextManager[Any]:
            return PerToken(seed, data) if self.seed_calls and seed is not None else contextlib.nullcontext()

        # Top-1 asserts tokens >= min_capacity: lowered to the call's tokens, the capacity still
        # holds every token (see the module docstring).
        fits = min(g.min_capacity, tokens)
        if not g.drop_tokens:
            experts, gates, _ = self._gate(x, draws, min_capacity=fits)
            return adapter.routes_from_arrays(experts.numpy(), gates.numpy()), None
        devices = [weight.device.index or 0] if weight.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # The choices before any drop, from the draws the call below makes again.
            experts, gates, _ = self._gate(x, draws, drop_tokens=False, min_capacity=fits)
        survivors, kept_gates, capacity = self._gate(x, draws, min_capacity=fits)
        kept = survivors >= 0
        if not torch.equal(survivors[kept], experts[kept]):
            t = int(torch.nonzero((survivors != experts) & kept)[0, 0])
            raise RuntimeError(f"moe_audit.deepspeed: token {t} chose other experts with drop_tokens=True than "
                               "with drop_tokens=False under the same random draws")
        weights = torch.where(kept, kept_gates, gates)
        capacity = max(capacity, g.min_capacity)
        return adapter.routes_from_arrays(experts.numpy(), weights.numpy(), kept.numpy()), capacity

    def run(self, argv: Sequence[str] | None = None) -> None:
        """Serves the gate on stdin/stdout (``moe-audit check --router-cmd``), or with
        ``--answer-plan DIR`` answers a trace plan."""
        adapter.run(self.route, self.name, self.experts, self.top_k, self.input, self.hidden_size,
                    argv=argv, protocol=self.protocol, seed_calls=self.seed_calls)


def _experts(moe: Any) -> Any:
    """The local experts of a ``deepspeed.moe.layer.MoE`` (``Experts.deepspeed_experts``)."""
    return moe.deepspeed_moe.experts.deepspeed_experts


def _ep_group(moe: Any) -> Any:
    """The layer's expert-parallel group, made as ``deepspeed.initialize`` makes it
    (``set_deepspeed_parallelism``, deepspeed/moe/layer.py:86-103) when the script has not."""
    if moe.deepspeed_moe.ep_group is None:
        with contextlib.redirect_stdout(sys.stderr):  # it prints the group's name (layer.py:92)
            moe.set_deepspeed_parallelism()
    return moe.deepspeed_moe.ep_group


class Layer:
    """A ``deepspeed.moe.layer.MoE`` run on this rank's sequences over its expert-parallel group
    (a :class:`moe_audit.distributed.Driver`).

    Per call: the rank's ``[b_local, seq_len, hidden]`` rows go in as ``MoE.forward`` takes them
    (``MOELayer`` flattens them sequence-major, sharded_moe.py:660); the choices before any drop
    come from the gate called as :class:`Gate` calls it, under a copy of the random state the
    layer then draws again, and the kept routes, their combine gates and the capacity from the
    layer's own gate call (its output caught as the layer makes it); the capacity is this rank's,
    computed over its own tokens (``_capacity``, sharded_moe.py:152-162). The output rows are the
    layer's output (``MoE.forward`` returns ``(output, l_aux, exp_counts)``).
    """

    def __init__(self, moe: torch.nn.Module, *, name: str | None = None, seed_calls: bool = False) -> None:
        self.moe = moe
        self.gate = Gate(moe, name=name, seed_calls=seed_calls)
        self.group = _ep_group(moe)
        self.experts, self.top_k, self.hidden_size = self.gate.experts, self.gate.top_k, self.gate.hidden_size
        self.dtype = next(_experts(moe).parameters()).dtype
        self.output_dtype = str(self.dtype).removeprefix("torch.")
        self.seed_calls = seed_calls
        g = self.gate.gate
        policy = f"cf{g.capacity_factor:g}" if g.drop_tokens else "dropless"
        sampled = "-sampled" if self.top_k == 2 and g.top2_2nd_expert_sampling else ""
        self.name = name or f"deepspeed-top{self.top_k}{sampled}-{policy}-ep{moe.ep_size}"

    @torch.no_grad()
    def forward(self, hidden: torch.Tensor, mode: str, seed: int | None) -> distributed.Local:
        self.moe.train(mode == "train")
        g = self.gate.gate
        data = hidden.numpy()
        x = hidden.to(g.wg.weight.device, g.wg.weight.dtype)
        flat = x.reshape(-1, self.hidden_size)

        def draws() -> AbstractContextManager[Any]:
            return PerToken(seed, data) if self.seed_calls and seed is not None else contextlib.nullcontext()

        devices = [x.device.index or 0] if x.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # min_capacity bounded by the tokens: only top-1 reads it without dropping, and asserts.
            fits = min(g.min_capacity, flat.shape[0])
            chosen, gates, _ = self.gate._gate(flat, draws, drop_tokens=False, min_capacity=fits)
        seen: dict[str, Any] = {}

        def keep(_module: Any, _args: Any, result: Any) -> None:
            _, capacity, _, survivors, _, kept_gates, _ = result
            seen.update(capacity=int(capacity), survivors=survivors.t().long().cpu(),
                        kept_gates=kept_gates.t().double().cpu())

        hook = g.register_forward_hook(keep)
        try:
            # As Gate.route: top-1 asserts tokens >= min_capacity (the module docstring), so a
            # short call lowers it to its tokens, the same on every rank (equal shards).
            with draws(), _set(g, min_capacity=fits):
                output, _, _ = self.moe(x.to(self.dtype))
        finally:
            hook.remove()
        survivors = seen["survivors"]
        kept = survivors >= 0
        if not torch.equal(survivors[kept], chosen[kept]):
            t = int(torch.nonzero((survivors != chosen) & kept)[0, 0])
            raise RuntimeError(f"moe_audit.deepspeed: token {t} chose other experts in the layer than under the same "
                               "random draws with drop_tokens=False")
        weights = torch.where(kept, seen["kept_gates"], gates)
        capacity = max(seen["capacity"], g.min_capacity) if g.drop_tokens else None
        out = output.detach().float().cpu().numpy().reshape(-1, self.hidden_size)
        return distributed.Local(chosen.numpy(), weights.numpy(), kept.numpy(), capacity,
                                 np.ascontiguousarray(out, dtype=np.float32))

    def fingerprint(self) -> str | None:
        """The gate's weight and every expert's parameters in global expert order (local expert i
        of EP rank r is global expert r * local + i), gathered over the expert-parallel group."""
        return distributed.experts_fingerprint(self.gate.gate.wg.weight, _experts(self.moe), self.group)


def seed_experts(moe: Any, seed: int = 0, std: float = 0.02) -> None:
    """Sets a ``deepspeed.moe.layer.MoE``'s gate weight and every expert's parameters from
    ``seed``, each expert's from a generator keyed by its global id: ``Experts`` deep-copies one
    module into every local expert (deepspeed/moe/experts.py:18), so all experts start equal, and
    the same script at another EP size would build another layer."""
    import torch.distributed as dist

    local = _experts(moe)
    first = dist.get_rank(_ep_group(moe)) * len(local) if dist.is_initialized() else 0
    distributed.seed_experts(find_gate(moe).wg.weight, local, first, seed, std)


def run_layer(moe: torch.nn.Module, placement: str = "contiguous", **options: Any) -> None:
    """Serves a ``deepspeed.moe.layer.MoE`` built on this rank to moe-audit across the launch's
    ranks (every rank calls it; see :mod:`moe_audit.distributed`); options ``name``, ``seed_calls``."""
    distributed.run_driver(Layer(moe, **options), placement)


def wrap(gate: torch.nn.Module, **options: Any) -> Gate:
    """A :class:`Gate` serving a ``TopKGate`` (or an ``MoE``'s or ``MOELayer``'s) to moe-audit:
    options ``seed`` (torch's global generator, once), ``name``, ``protocol``, ``seed_calls``."""
    return Gate(gate, **options)


def run(gate: torch.nn.Module, argv: Sequence[str] | None = None, **options: Any) -> None:
    """Serves to ``moe-audit check --router-cmd``: a ``deepspeed.moe.layer.MoE`` in a process
    launched by ``torch.distributed.run`` (``RANK`` set) as a layer across the launch's ranks
    (:func:`run_layer`, options ``placement``, ``name``, ``seed_calls``), anything else as its gate
    (``wrap(gate, **options).run(argv)``)."""
    from deepspeed.moe.layer import MoE

    if isinstance(gate, MoE) and "RANK" in os.environ:
        run_layer(gate, **options)
    else:
        wrap(gate, **options).run(argv)


__all__ = ["Gate", "Layer", "find_gate", "run", "run_layer", "seed_experts", "wrap"]

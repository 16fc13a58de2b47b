"""Finds every router of a torch module by structure, and decodes what it returns into routes.

A **router** is found from what it is, not from its class name: a module beside an *experts
container* (a ModuleList/ModuleDict of E experts, or a module holding E-stacked 3-D weights) in
the same MoE block, that holds a gate projection to those E experts (a 2-D weight ``[E, H]``: a
Linear or a bare parameter). The block's other children with weights are its shared experts.

What a router returns is decoded by the first registered decoder that accepts it (see
:func:`register_decoder`); the built-in ones read, by shape and dtype:

- ``(..., [T, E] logits, ..., [T, k] weights, [T, k] int ids)`` in any order (most routers of
  transformers 5: Mixtral, Qwen, DeepSeek, GLM, MiniMax, ...), or logits alone when the block
  hands ``(ids, weights)`` to its experts (DBRX: read there);
- ``(scores [T, E], logits [T, E])`` with scores zero outside the top k (Llama 4);
- a capacity router (one with an ``expert_capacity``): a one-hot dispatch ``[B, S, E]`` after
  dropping with the top-1 gate ``[B, S, 1]`` (Switch: first come first served per sequence), or a
  top-1 mask ``[T, E]`` with the combine weights ``[T, E]`` (NLLB-MoE: one capacity per call);
- a sorted dispatch: ``(order [T*k], token [T*k], gates [T*k], sizes [E], logits)`` (JetMoE).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence, Sized
from dataclasses import dataclass
from typing import Any, Callable, Union, cast

import numpy as np
import numpy.typing as npt
import torch

from ..errors import MoeAuditError

#: What a router's forward hook saw: its positional arguments.
Inputs = Sequence[Any]
#: The (ids [T, k], weights [T, k]) an experts module was called with, when found.
Dispatch = Union[tuple[torch.Tensor, torch.Tensor], None]
#: ``accepts(router, output)``: whether a decoder reads what the router returned.
Accepts = Callable[[torch.nn.Module, Any], bool]
#: ``decode(router, inputs, output, dispatch)``: the routes of one forward.
Decode = Callable[[torch.nn.Module, Inputs, Any, Dispatch], "Decoded"]


class NotCovered(MoeAuditError, TypeError):
    """A module with no router found, or a router no decoder reads (the message says what to do)."""


@dataclass
class Decoded:
    """One forward of one router: T tokens (batch*seq_len, sequence-major), k routes each."""

    #: int32 [T, k] in choice order; -1: no route (padding a router leaves out).
    experts: np.ndarray
    #: float32 [T, k]: combine weights (a dropped route: its gate before dropping).
    weights: np.ndarray
    #: bool [T, k].
    kept: np.ndarray
    #: float32 [T, E] router logits, when the router returns them.
    logits: np.ndarray | None = None
    #: None (dropless), E slot counts for the call, or {"scope", "slots"}.
    capacity: Any = None

    @classmethod
    def of(cls, experts: torch.Tensor | npt.ArrayLike, weights: torch.Tensor | npt.ArrayLike,
           kept: torch.Tensor | npt.ArrayLike | None = None, logits: torch.Tensor | npt.ArrayLike | None = None,
           capacity: Any = None, present: torch.Tensor | npt.ArrayLike | None = None, order: bool = True) -> Decoded:
        """From tensors or arrays of any leading shape (flattened to [T, k]). ``order``: put each
        token's routes in decreasing weight (ties: lower expert id), the choice order of a sorted
        top-k; routers that pick unsorted then compare alike. ``present`` [T] or [T, k]: False
        for routes that do not exist (their expert is -1)."""
        experts = _numpy(experts).astype(np.int64)
        k = experts.shape[-1]
        experts = experts.reshape(-1, k)
        weights = _numpy(weights).astype(np.float32).reshape(-1, k)
        flags = np.ones(experts.shape, dtype=bool) if kept is None else _numpy(kept).astype(bool).reshape(-1, k)
        if order and k > 1:
            # lexsort: last key first; stable, so equal weights keep the lower expert id first.
            idx = np.lexsort((experts, -weights.astype(np.float64)), axis=1)
            experts, weights, flags = (np.take_along_axis(a, idx, axis=1) for a in (experts, weights, flags))
        if present is not None:
            present = np.broadcast_to(_numpy(present).astype(bool).reshape(len(experts), -1), experts.shape)
            experts = np.where(present, experts, -1)
            weights = np.where(present, weights, 0.0).astype(np.float32)
            flags = flags & present
        if logits is not None:
            logits = _numpy(logits).astype(np.float32)
            logits = logits.reshape(-1, logits.shape[-1])
        return cls(experts.astype(np.int32), weights, flags, logits, capacity)


@dataclass
class Site:
    """One router of a model: where it is, what it routes, and how to read it."""

    layer: int
    kind: str
    name: str
    module: torch.nn.Module
    experts: int
    top_k: int | None
    shared_experts: bool
    #: The MoE block holding the router (the router itself when found alone), and its experts
    #: container (None when found alone).
    block: torch.nn.Module
    experts_module: torch.nn.Module | None = None
    #: Found on the router's first forward (:func:`decoder_for`).
    decoder: Decoder | None = None

    def decode(self, inputs: Inputs, output: Any, dispatch: Dispatch = None) -> Decoded:
        """Decoded of one forward, from the router's forward hook (inputs: its positional args,
        output: what it returned); ``dispatch``: the (ids, weights) its experts were called with,
        for routers that leave the top-k to their block."""
        if self.decoder is None:
            self.decoder = decoder_for(self.module, output)
        return self.decoder.decode(self.module, inputs, output, dispatch)


@dataclass
class Model:
    """Every router of a module, and what each decoder layer is."""

    sites: list[Site]
    #: Every decoder layer: number -> "moe", "mtp" or "dense".
    layers: dict[int, str]
    config: Any
    root: torch.nn.Module
    #: Routers found but not audited (a second router in a layer).
    unaudited: list[Site]

    def site(self, layer: int) -> Site:
        return next(s for s in self.sites if s.layer == layer)


@dataclass(frozen=True)
class Decoder:
    """A way to read a router's output: ``accepts(router, output)`` and
    ``decode(router, inputs, output, dispatch) -> Decoded``."""

    name: str
    accepts: Accepts
    decode: Decode


def _numpy(x: torch.Tensor | npt.ArrayLike) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x)


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a router's output, in order (a tensor, or a tuple/list of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for t in output if isinstance(t, torch.Tensor)]
    return []


def _hidden(inputs: Inputs) -> torch.Tensor | None:
    return next((x for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point()), None)


def _tokens(inputs: Inputs) -> int | None:
    """T: the token count of a router's input."""
    x = _hidden(inputs)
    return None if x is None else x.numel() // x.shape[-1]


def _by_width(tensors: list[torch.Tensor], tokens: int, width: int, floating: bool) -> list[torch.Tensor]:
    return [t for t in tensors if t.is_floating_point() == floating and t.shape[-1:] == (width,)
            and t.numel() == tokens * width]


def module_attribute(module: torch.nn.Module, name: str) -> Any:
    """A plain attribute of a module (a number, a method of a model class): torch types every
    module attribute as a tensor or a module."""
    return getattr(module, name)


def _experts_of(router: torch.nn.Module) -> int:
    return int(module_attribute(router, "_moe_audit_experts"))


# --- built-in decoders -------------------------------------------------------------------------

def _capacity_top1_accepts(router: torch.nn.Module, output: Any) -> bool:
    t = _tensors(output)
    return (hasattr(router, "expert_capacity") and len(t) == 3 and t[1].shape[-1] == 1
            and t[0].shape[-1] == _experts_of(router) and not t[0].is_floating_point())


def _capacity_top1(router: torch.nn.Module, inputs: Inputs, output: Any, dispatch: Dispatch) -> Decoded:
    # (dispatch one-hot [B, S, E], zero where capacity dropped; top-1 prob [B, S, 1]; logits):
    # cumsum over each sequence, so one capacity per sequence, first come first served.
    mask, probs, logits = _tensors(output)
    experts = logits.float().softmax(-1).argmax(-1).reshape(-1, 1)
    kept = mask.reshape(-1, mask.shape[-1]).sum(-1, keepdim=True) > 0
    batch = mask.shape[0] if mask.ndim == 3 else 1
    capacity = {"scope": "sequence", "slots": [int(module_attribute(router, "expert_capacity"))] * batch}
    return Decoded.of(experts, probs.reshape(-1, 1), kept, logits, capacity)


def _capacity_top2_accepts(router: torch.nn.Module, output: Any) -> bool:
    t = _tensors(output)
    e = _experts_of(router)
    return (hasattr(router, "expert_capacity") and len(t) == 3 and all(x.shape[-1] == e for x in t)
            and hasattr(router, "classifier"))


def _capacity_top2(router: torch.nn.Module, inputs: Inputs, output: Any, dispatch: Dispatch) -> Decoded:
    # (top-1 dispatch [T, E] after capacity; combine weights [T, E], 0 where dropped; logits
    # [T, E], with the Gumbel noise of the "sampling" policy added in place). Second choices
    # queue after every first choice: one capacity per call.
    top1_mask, combine, noisy = _tensors(output)
    x = _hidden(inputs)
    if x is None:
        raise NotCovered(_unread(router, output))
    classifier = module_attribute(router, "classifier")
    logits = classifier(x.reshape(-1, x.shape[-1]).to(classifier.weight.dtype))
    probs = logits.float().softmax(-1)
    top1 = probs.argmax(-1)
    top2 = noisy.reshape(probs.shape).masked_fill(
        torch.nn.functional.one_hot(top1, probs.shape[-1]).bool(), float("-inf")).argmax(-1)
    experts = torch.stack([top1, top2], 1)
    p = probs.gather(1, experts)
    before = p / p.sum(1, keepdim=True).clamp(min=torch.finfo(p.dtype).eps)
    combine = combine.reshape(probs.shape).float()
    kept = torch.stack([top1_mask.reshape(probs.shape).gather(1, top1[:, None])[:, 0] > 0,
                        combine.gather(1, top2[:, None])[:, 0] > 0], 1)
    weights = torch.where(kept, combine.gather(1, experts), before)
    present = None
    padding = inputs[1] if len(inputs) > 1 and isinstance(inputs[1], torch.Tensor) else None
    if padding is not None and padding.ndim == 4:  # an attention mask: its last query row, as the router reads it
        padding = padding[:, :, -1, :].reshape(-1)[-probs.shape[0]:]
    if padding is not None and not getattr(router, "router_ignore_padding_tokens", True):
        present = ~padding.bool().reshape(-1, 1)  # the router masks padding out of both choices
    capacity = [int(module_attribute(router, "expert_capacity"))] * probs.shape[-1]
    return Decoded.of(experts, weights, kept, logits, capacity, present=present, order=False)


def _sorted_dispatch_accepts(router: torch.nn.Module, output: Any) -> bool:
    if not isinstance(output, (tuple, list)) or len(output) != 5:
        return False
    order, token, gates, sizes, logits = output
    return (all(isinstance(t, torch.Tensor) and t.ndim == 1 for t in (order, token, gates))
            and len(sizes) == _experts_of(router) and logits.shape[-1] == _experts_of(router))


def _sorted_dispatch(router: torch.nn.Module, inputs: Inputs, output: Any, dispatch: Dispatch) -> Decoded:
    # order: positions in the flattened [T, k] top-k, sorted by expert; sizes: routes per expert.
    order, _, gates, sizes, logits = output
    tokens = logits.numel() // logits.shape[-1]
    k = order.numel() // tokens
    experts = torch.repeat_interleave(torch.arange(len(sizes)), torch.as_tensor(sizes, dtype=torch.long))
    flat_e = torch.empty_like(order)
    flat_w = torch.empty_like(gates)
    flat_e[order] = experts
    flat_w[order] = gates
    return Decoded.of(flat_e.reshape(tokens, k), flat_w.reshape(tokens, k), logits=logits)


def _generic_accepts(router: torch.nn.Module, output: Any) -> bool:
    e = _experts_of(router)
    t = _tensors(output)
    return any(x.is_floating_point() and x.shape[-1] in (e, e + 1) for x in t)


def _generic(router: torch.nn.Module, inputs: Inputs, output: Any, dispatch: Dispatch) -> Decoded:
    e = _experts_of(router)
    tokens = _tokens(inputs)
    if tokens is None:
        raise NotCovered(_unread(router, output))
    out = _tensors(output)
    # [T, E] logits or scores ([T, E + 1]: a router that also scores a skip or shared expert).
    dense = _by_width(out, tokens, e, True) or _by_width(out, tokens, e + 1, True)
    logits = dense[-1] if len(dense) > 1 and _sparse(dense[0]) else (dense[0] if dense else None)
    ids = [t for t in out if not t.is_floating_point() and t.ndim >= 1 and t.shape[-1] < e
           and t.numel() % tokens == 0 and t.numel() // tokens == t.shape[-1]]
    if dispatch is not None:
        # What the experts were called with: what the block combines (scaling included).
        return Decoded.of(dispatch[0], dispatch[1], logits=logits)
    if ids:
        k = ids[0].shape[-1]
        weights = _by_width(out, tokens, k, True)
        if weights:
            return Decoded.of(ids[0], weights[0], logits=logits)
        if len(dense) > 1:  # the weights scattered into [T, E]
            return Decoded.of(ids[0], dense[0].reshape(tokens, e).gather(1, ids[0].reshape(tokens, k)), logits=logits)
    if len(dense) > 1 and _sparse(dense[0]):
        # scores [T, E]: the gate of the top k, 0 elsewhere; logits: which k.
        k = _top_k(router)
        scores = dense[0].reshape(tokens, e)
        assert logits is not None  # dense[-1]
        experts = torch.topk(logits.reshape(tokens, e), k, dim=-1).indices
        return Decoded.of(experts, scores.gather(1, experts), logits=logits)
    raise NotCovered(_unread(router, output))


def _sparse(scores: torch.Tensor) -> bool:
    """Whether a [.., E] tensor is zero (or -inf) outside a few entries per token."""
    s = scores.reshape(-1, scores.shape[-1])
    live = (s != 0) & torch.isfinite(s)
    return bool((live.sum(-1) < s.shape[-1]).all())


def _top_k(router: torch.nn.Module) -> int:
    k = getattr(router, "top_k", None) or getattr(router, "_moe_audit_top_k", None)
    if not k:
        raise NotCovered(f"the top-k of {type(router).__name__} is unknown: no top_k attribute and no config")
    return int(k)


BUILTIN_DECODERS = [
    Decoder("capacity-top1 (per sequence)", _capacity_top1_accepts, _capacity_top1),
    Decoder("capacity-top2 (per call)", _capacity_top2_accepts, _capacity_top2),
    Decoder("sorted-dispatch", _sorted_dispatch_accepts, _sorted_dispatch),
    Decoder("top-k", _generic_accepts, _generic),
]
#: (what was registered, its predicate, its decoder), latest first.
_REGISTERED: list[tuple[Any, Callable[[torch.nn.Module], bool], Decoder]] = []


def register_decoder(router: type | Callable[[torch.nn.Module], bool], decode: Callable[..., Decoded],
                     name: str | None = None) -> Decoder:
    """Reads ``router`` (a class, or a predicate ``f(module) -> bool``) with
    ``decode(router, inputs, output) -> Decoded`` (or ``decode(router, inputs, output,
    dispatch)``: the (ids, weights) its experts got), before any built-in decoder."""
    match: Callable[[torch.nn.Module], bool]
    if isinstance(router, type):
        cls = router

        def match(m: torch.nn.Module) -> bool:
            return isinstance(m, cls)
    else:
        match = router
    takes_dispatch = len(inspect.signature(decode).parameters) >= 4

    def call(module: torch.nn.Module, inputs: Inputs, output: Any, dispatch: Dispatch) -> Decoded:
        return decode(module, inputs, output, dispatch) if takes_dispatch else decode(module, inputs, output)

    decoder = Decoder(name or str(getattr(decode, "__name__", "registered")), lambda m, out: True, call)
    _REGISTERED.insert(0, (router, match, decoder))
    return decoder


def unregister_decoder(router: Any) -> None:
    """Forgets the decoders registered for ``router`` (the class or predicate given)."""
    _REGISTERED[:] = [r for r in _REGISTERED if r[0] is not router]


def decoder_for(router: torch.nn.Module, output: Any) -> Decoder:
    """The decoder that reads this router's output (registered ones first)."""
    for _, match, decoder in _REGISTERED:
        if match(router):
            return decoder
    for decoder in BUILTIN_DECODERS:
        if decoder.accepts(router, output):
            return decoder
    raise NotCovered(_unread(router, output))


def _unread(router: torch.nn.Module, output: Any) -> str:
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in _tensors(output))
    cls = type(router)
    return (
        f"no decoder reads {cls.__name__} (module {getattr(router, '_moe_audit_path', '?')}, "
        f"{_experts_of(router)} experts): it returned ({shapes}); searched for [T, k] ids with "
        f"[T, k] weights, [T, E] scores, a capacity dispatch, or ids handed to its experts. Register one:\n"
        f"    import moe_audit.hf\n"
        f"    from {cls.__module__} import {cls.__name__}\n"
        f"    def decode(router, inputs, output):\n"
        f"        logits = output[0]  # [tokens, {_experts_of(router)}]: adapt to what it returns\n"
        f"        weights, experts = logits.softmax(-1).topk(router.top_k, dim=-1)\n"
        f"        return moe_audit.hf.Decoded.of(experts, weights, logits=logits)\n"
        f"    moe_audit.hf.register_decoder({cls.__name__}, decode)"
    )


# --- discovery ---------------------------------------------------------------------------------

#: Config fields that give the number of routed experts, and experts per token.
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_routed_experts",
                 "n_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k", "top_k",
                "router_top_k", "n_activated_experts")
#: The first index in a module path: the decoder layer (``model.layers.3.mlp.gate``: 3).
_LAYER = re.compile(r"^(.*?)(?:^|\.)(\d+)(?:\.|$)")
_MTP = re.compile(r"(?:^|\.)(?:mtp|nextn)\w*(?:\.|$)", re.I)


def _expert_count(module: torch.nn.Module) -> int | None:
    """E when module is an experts container (E modules in a list/dict, E-stacked 3-D weights,
    or a module called with (hidden, ids, weights) that says it has E), else None."""
    if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
        # Experts are small (an MLP); a list of decoder layers is not an experts container.
        weighted = [type(m) for m in module.children() if any(True for _ in m.parameters())
                    and sum(1 for _ in m.modules()) <= 8]
        return len(weighted) if len(weighted) > 1 and len(set(weighted)) == 1 else None
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return None  # [channels, 1, kernel]: a depthwise convolution, not stacked experts
    stacked = {p.shape[0] for p in module.parameters(recurse=False) if p.ndim == 3}
    if stacked:
        # LongCat stacks one more up-projection than down-projections: its identity expert.
        return max(stacked)
    n = getattr(module, "num_experts", None)
    try:
        takes = len(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        takes = 0
    if isinstance(n, int) and n > 1 and takes >= 3 and any(True for _ in module.parameters()):
        return n
    return None


def gate_weight(module: torch.nn.Module, experts: int) -> torch.nn.Parameter | None:
    """The [E, H] gate weight held by module (itself or a descendant), or None."""
    # E rows (E + 1: a router that also scores its shared expert).
    return next((p for p in module.parameters() if p.ndim == 2 and p.shape[0] in (experts, experts + 1)
                 and p.shape[1] > 1), None)


def _is_router(module: torch.nn.Module, experts: int) -> bool:
    """Whether module is a gate to E experts: an [E, H] weight (a Linear, a parameter, a small
    MLP), not a stack of layers."""
    return gate_weight(module, experts) is not None and not any(
        isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) for m in module.modules())


def _holds_router(container: torch.nn.Module, experts: int) -> bool:
    """Whether a candidate container holds a router (so it is a block or a layer, not experts):
    an [E, H] gate in one of its submodules (its own E-row weights are expert biases)."""
    return any(gate_weight(m, experts) is not None for m in container.children())


def config_value(config: Any, fields: Sequence[str]) -> int | None:
    for c in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        if c is None:
            continue
        for f in fields:
            v = getattr(c, f, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


#: (block path, block, router name, router, experts container, E) of an MoE block.
Block = tuple[str, torch.nn.Module, str, torch.nn.Module, Union[torch.nn.Module, None], int]


def _blocks(root: torch.nn.Module) -> list[Block]:
    """(block path, block, router name, router, experts container, E) of every MoE block."""
    found: list[Block] = []
    for path, block in root.named_modules():
        children = dict(block.named_children())
        for _xname, container in children.items():
            e = _expert_count(container)
            if e is None or _holds_router(container, e):
                continue  # not a container, or it holds a router itself (a block or a layer)
            router = next(((n, m) for n, m in children.items() if m is not container and _is_router(m, e)), None)
            if router is not None:
                found.append((path, block, router[0], router[1], container, e))
                break
    return found


def discover(module: torch.nn.Module, config: Any = None) -> Model:
    """Every router in ``module`` (a router's block, a decoder layer, a whole model), ordered
    by global layer (MTP layers after the backbone). Raises NotCovered when there is none."""
    config = config if config is not None else getattr(module, "config", None)
    k_config = config_value(config, TOP_K_FIELDS) if config is not None else None
    blocks = _blocks(module)
    if not blocks:
        # A router given alone: its own [E, H] gate (or its Linear's), E from attributes or config.
        e = getattr(module, "num_experts", None) or (config_value(config, EXPERT_FIELDS) if config else None)
        own = [p for p in module.parameters(recurse=False)] + [
            c.weight for c in module.children() if isinstance(c, torch.nn.Linear)]
        if isinstance(e, int) and any(p.ndim == 2 and p.shape[0] == e for p in own):
            blocks = [("", module, "", module, None, e)]
    if not blocks:
        searched = ", ".join(EXPERT_FIELDS)
        raise NotCovered(
            f"no router in {type(module).__name__}: searched every submodule for an experts container "
            f"(a ModuleList/ModuleDict of E experts or E-stacked 3-D weights) beside a gate projection to "
            f"those E experts ([E, H] weight); config fields read: {searched}")
    sites = []
    for path, block, rname, router, container, e in blocks:
        name = f"{path}.{rname}".strip(".") if rname else path
        layer = _LAYER.match(name)
        shared = any(m is not router and m is not container and any(True for _ in m.parameters())
                     and gate_weight(m, e) is None and sum(p.numel() for p in m.parameters()) > e
                     for m in block.children())
        top_k = getattr(router, "top_k", None) or getattr(block, "top_k", None) or k_config
        site = Site(layer=int(layer.group(2)) if layer else 0, kind="mtp" if _MTP.search(name) else "moe", name=name,
                    module=router, experts=e, top_k=int(top_k) if top_k else None, shared_experts=shared,
                    block=block, experts_module=container)
        # Read by the decoders and their messages (plain attributes: torch keeps them in __dict__).
        vars(router).update(_moe_audit_experts=e, _moe_audit_path=name, _moe_audit_top_k=site.top_k)
        sites.append(site)
    layers = _layers(module, sites)
    backbone = max((n for n, kind in layers.items() if kind != "mtp"), default=-1) + 1
    for s in sites:
        if s.kind == "mtp" and s.layer < backbone:
            s.layer += backbone
    for s in sites:
        layers[s.layer] = s.kind
    # One router per layer: a layer with two (JetMoE's attention heads are routed too) is
    # audited at its last one, the feed-forward block; the others are listed in ``unaudited``
    # (WholeModel audits one of those instead when the last does not run on token ids).
    last = {s.layer: s for s in sites}
    unaudited = [s for s in sites if last[s.layer] is not s]
    sites = sorted(last.values(), key=lambda s: (s.kind == "mtp", s.layer))
    return Model(sites=sites, layers=dict(sorted(layers.items())), config=config, root=module, unaudited=unaudited)


def _layers(root: torch.nn.Module, sites: list[Site]) -> dict[int, str]:
    """Every decoder layer of the lists that hold the routers: number -> "moe" | "dense"."""
    layers: dict[int, str] = {}
    for s in sites:
        m = _LAYER.match(s.name)
        if m and s.kind == "moe":
            stack = root.get_submodule(m.group(1)) if m.group(1) else root
            layers.update((i, "dense") for i in range(len(cast(Sized, stack))) if i not in layers)
    for s in sites:
        if s.kind == "moe":
            layers[s.layer] = "moe"
    return layers

"""Audit one Hugging Face ``transformers`` MoE router block on hidden states (``moe-audit/2``).

::

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    import moe_audit.hf

    moe_audit.hf.run(MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, num_local_experts=8)))

serves the block to ``moe-audit check --router-cmd "python3 this_file.py"``;
``moe_audit.check(moe_audit.hf.wrap(block), probes="P,F")`` audits it from this process.

``wrap`` finds the router inside the module it is given by structure (:func:`moe_audit.hf.discover`:
a router, an MoE block, or a layer holding one: the first router found), and per call:

- switches the module to ``.train()`` or ``.eval()`` from the request's mode;
- feeds the hidden states through the MoE block that holds the router (so what the block does
  before routing, such as Mixtral's jitter, is audited too), or through the router alone when
  given one, and stops where the block hands the routes to its experts (the experts never run);
- decodes the router's outputs into routes in choice order with kept flags, and its capacity with
  its scope (per sequence for Switch, per call for NLLB-MoE).

A router whose gate was never initialised (built from a config, not loaded: ``torch.empty`` or
zeros) gets a seeded normal gate (std ``1/sqrt(hidden)``) and zero bias, so every run routes
alike; ``init=False`` keeps the weights as they are, ``init=True`` always re-initialises. The
global torch generator is seeded with ``seed`` once, so a whole audit is reproducible; a random
router (jitter, sampled second experts) still draws fresh noise on every call, which the audit's
D probe reports. ``seed_calls=True`` (``moe-audit/2``) makes every random draw of a call per
token instead, from a generator keyed on the request's seed and the token's own input row
(:mod:`moe_audit.hf.seeded`): a token's noise then depends on nothing but the token, so the same
call draws the same noise (D) and the other probes see the router's own dependence on other
tokens, not noise keyed on the call's shape (seeding torch once per call would shift every
token's noise with the prefix, the batch or the layout: P, R and L "leaks"). A random draw that
cannot be attributed to a token raises :class:`moe_audit.hf.seeded.NotKeyed`. A block that takes
a ``padding_mask`` (NLLB-MoE) gets the request's over ``moe-audit/2``. Needs torch and
transformers.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import adapter
from .._wire import v1, v2
from .capture import dispatch_args
from .routers import BUILTIN_DECODERS, Decoder, Inputs, Site, discover, gate_weight
from .seeded import PerToken

#: Deprecated: routers are found by structure and read by decoders (:data:`FAMILIES` lists the
#: built-in ones); kept so code naming them still imports.
Family = Decoder
FAMILIES = tuple(BUILTIN_DECODERS)


def find_router(module: torch.nn.Module) -> tuple[str, torch.nn.Module, Site]:
    """Deprecated: (path, router, site) of the first router in module (module itself included);
    use :func:`moe_audit.hf.discover`."""
    site = discover(module).sites[0]
    return site.name, site.module, site


class _Routed(Exception):
    """Raised by a hook once the routes are known: the experts need not run."""


def _initialise(router: torch.nn.Module, gate: torch.nn.Parameter, seed: int, init: bool | None) -> None:
    if init is None:
        # transformers marks the parameters it loaded from a checkpoint.
        loaded = getattr(gate, "_is_hf_initialized", False)
        with torch.no_grad():
            blank = not bool(torch.isfinite(gate).all()) or not bool(gate.any())
        init = blank or not loaded
    if init:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            gate.copy_(torch.randn(gate.shape, generator=g) / math.sqrt(gate.shape[1]))
            for m in router.modules():
                if isinstance(m, torch.nn.Linear) and m.weight is gate and m.bias is not None:
                    m.bias.zero_()


class Router:
    """A wrapped transformers router: ``route(data, mode, seed, padding)`` and the handshake
    attributes (``name``, ``experts``, ``top_k``, ``input``, ``hidden_size``, ``protocol``,
    ``padding_mask``, ``seed_calls``) that ``moe_audit.run``, ``moe_audit.check`` and the snapshot
    helper read."""

    input = "hidden"

    def __init__(self, module: torch.nn.Module, *, seed: int = 0, init: bool | None = None, name: str | None = None,
                 protocol: adapter.Protocol = v2.PROTOCOL, seed_calls: bool = False) -> None:
        self.site = discover(module).sites[0]
        self.module = module
        self.router = self.site.module
        # The block that holds the router (what a model calls), or the router when given alone.
        self.block = self.site.block
        self.experts = self.site.experts
        gate = self._gate()
        self.hidden_size = int(gate.shape[1])
        self.protocol = adapter.protocol_name(protocol)
        takes = inspect.signature(self.block.forward).parameters
        # moe-audit/2 sends a padding mask to a block that takes one.
        self.padding_mask = "padding_mask" in takes and self.protocol != v1.PROTOCOL
        self.seed_calls = seed_calls
        _initialise(self.router, gate, seed, init)
        # One call (training mode: an inference call may set state, as NLLB's capacity) finds
        # the decoder and the routes per token.
        self.top_k = self.site.top_k
        x = np.zeros((1, 2, self.hidden_size), dtype=np.float32)
        routes, _ = self.route(x, "train")
        self.top_k = self.top_k or int(routes.experts.shape[1])
        self.name = name or f"hf-{type(self.router).__name__}"
        torch.manual_seed(seed)

    def _gate(self) -> torch.nn.Parameter:
        gate = gate_weight(self.router, self.experts)
        assert gate is not None, "discover() found the router by its gate"
        return gate

    def __repr__(self) -> str:
        return (f"moe_audit.hf.Router({type(self.router).__name__} in {type(self.block).__name__}: "
                f"{self.experts} experts, top {self.top_k}, hidden {self.hidden_size})")

    @torch.no_grad()
    def route(self, data: Any, mode: str, seed: int | None = None,
              padding: Any = None) -> tuple[adapter.Routes, adapter.Capacity]:
        """Routes data [batch, seq_len, hidden] (float32) in mode "train" or "inference"; with
        ``seed_calls`` and the request's seed (``moe-audit/2``), every random draw of the call is
        keyed per token on the seed and the token's row (:class:`moe_audit.hf.seeded.PerToken`)."""
        self.module.train(mode == "train")
        dtype = self._gate().dtype
        # A copy: blocks scale their input in place (jitter).
        x = torch.tensor(np.asarray(data), dtype=dtype)
        seen: dict[str, Any] = {}

        def router_hook(module: torch.nn.Module, args: Inputs, output: Any) -> None:
            seen["inputs"], seen["output"] = args, output
            if self.block is self.router:
                raise _Routed

        def experts_hook(module: torch.nn.Module, args: Inputs, kwargs: dict[str, Any]) -> None:
            seen["dispatch"] = dispatch_args(self.site, args, kwargs)
            raise _Routed

        kwargs: dict[str, torch.Tensor] = {}
        if padding is not None and self.padding_mask:
            kwargs["padding_mask"] = torch.from_numpy(np.asarray(padding, dtype=bool).reshape(-1))
        handles = [self.router.register_forward_hook(router_hook)]
        if self.site.experts_module is not None:
            handles.append(self.site.experts_module.register_forward_pre_hook(experts_hook, with_kwargs=True))
        seeded = PerToken(seed, data) if self.seed_calls and seed is not None else contextlib.nullcontext()
        try:
            with seeded:
                try:
                    self.block(x, **kwargs)
                except _Routed:
                    pass
        finally:
            for h in handles:
                h.remove()
        if "output" not in seen:
            raise RuntimeError(f"{type(self.block).__name__} did not call its router")
        d = self.site.decode(seen["inputs"], seen["output"], seen.get("dispatch"))
        return adapter.routes_from_arrays(d.experts, d.weights, d.kept, d.experts >= 0), d.capacity

    def run(self, argv: Sequence[str] | None = None) -> None:
        """Serves the router on stdin/stdout (``moe-audit check --router-cmd``), or with
        ``--answer-plan DIR`` answers a trace plan."""
        adapter.run(self.route, self.name, self.experts, self.top_k, self.input, self.hidden_size,
                    argv=argv, protocol=self.protocol, padding_mask=self.padding_mask, seed_calls=self.seed_calls)

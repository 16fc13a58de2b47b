"""Audit a Hugging Face ``transformers`` MoE router in one call.

::

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    import moe_audit.hf

    moe_audit.hf.run(MixtralSparseMoeBlock(MixtralConfig(hidden_size=64, num_local_experts=8)))

serves the block to ``moe-audit check --router-cmd "python3 this_file.py"``;
``moe_audit.check(moe_audit.hf.wrap(block), "--format", "json")`` audits it from this process.

``wrap`` finds the router inside the module it is given (a router, an MoE block, or a layer or
model holding one: the first router found), and per call:

- switches the module to ``.train()`` or ``.eval()`` from the request's mode;
- feeds the hidden states through the MoE block that holds the router (so what the block does
  before routing, such as Mixtral's jitter, is audited too), or through the router alone when
  given one, and stops at the router's output (the experts never run);
- maps the router's outputs to routes in choice order with kept flags, and its capacity with its
  scope (per sequence for Switch, per call for NLLB-MoE).

A router whose gate was never initialised (built from a config, not loaded: ``torch.empty`` or
zeros) gets a seeded normal gate (std ``1/sqrt(hidden)``) and zero bias, so every run routes
alike; ``init=False`` keeps the weights as they are, ``init=True`` always re-initialises. The
global torch generator is seeded with ``seed`` once, so a whole audit is reproducible; a random
router (jitter, sampled second experts) still draws fresh noise on every call, which the audit's
D probe reports. ``seed_calls=True`` (``moe-audit/2``) seeds it with the request's seed before
every call instead: the same call then draws the same noise.

Covered routers (class names): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, PhiMoE
(top-k; PhiMoE samples its choices in training), DeepSeek-V3 (group-limited sigmoid with a selection bias), Llama 4 (top-k sigmoid),
GPT-OSS (softmax over the top-k logits), Switch Transformers (top-1, capacity per sequence,
first come first served) and NLLB-MoE (top-2, capacity per call, second-expert policies
``all``, ``sampling`` and ``random``; over ``moe-audit/2`` it takes the padding mask and leaves
padding unrouted, as it does). Needs torch and transformers.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import adapter
from ._wire import v1, v2


@dataclass(frozen=True)
class Family:
    """How to drive one kind of router: its classes, the shape it takes, how to read it."""

    name: str
    #: Router class names.
    classes: tuple
    #: Whether the router takes hidden states [tokens, hidden] (True) or [batch, seq, hidden].
    flat: bool
    #: decode(router, x, out, batch) -> (experts [T, k], weights [T, k], kept [T, k] or None,
    #: capacity): x is the router's input and out its output, as the hook saw them.
    decode: object
    top_k: object = None
    #: Whether the router takes a padding mask (``padding_mask``, True for padding).
    padding: bool = False

    def k(self, router):
        """Experts per token."""
        return self.top_k if self.top_k is not None else int(router.top_k)


def _topk(router, x, out, batch):
    # (logits, top-k weights, top-k experts), top-k sorted: choice order as given.
    _, weights, experts = out
    return experts, weights, None, None


def _deepseek_v3(router, x, out, batch):
    # topk(sorted=False): order the chosen experts by their biased selection score.
    logits, weights, experts = out
    choice = (logits.sigmoid() + router.e_score_correction_bias).gather(1, experts)
    order = torch.argsort(-choice, dim=1, stable=True)
    return experts.gather(1, order), weights.gather(1, order), None, None


def _llama4(router, x, out, batch):
    # (scores [T, E]: sigmoid of the top-k logits, 0 elsewhere; logits [T, E]).
    scores, logits = out
    experts = torch.topk(logits, router.top_k, dim=1).indices
    return experts, scores.gather(1, experts), None, None


def _switch(router, x, out, batch):
    # (dispatch one-hot [B, S, E], zero where capacity dropped; top-1 prob [B, S, 1]; logits).
    dispatch, probs, logits = out
    e = router.num_experts
    full = torch.nn.functional.softmax(logits, dim=-1, dtype=router.dtype).to(router.input_dtype)
    experts = full.argmax(dim=-1).reshape(-1, 1)
    kept = dispatch.reshape(-1, e).sum(dim=-1, keepdim=True) > 0
    # First come first served within each sequence: one capacity per sequence.
    capacity = {"scope": "sequence", "slots": [int(router.expert_capacity)] * batch}
    return experts, probs.reshape(-1, 1), kept, capacity


def _nllb(router, x, out, batch):
    # (top-1 dispatch [T, E] after capacity; combine weights [T, E], 0 where dropped; logits [T, E]
    # with the Gumbel noise of the "sampling" policy added in place).
    dispatch1, combine, noisy_logits = out
    logits = router.classifier(x.to(router.dtype))
    probs = torch.nn.functional.softmax(logits, dim=-1, dtype=router.dtype).to(router.input_dtype)
    top1 = probs.argmax(dim=-1)
    top2 = noisy_logits.masked_fill(torch.nn.functional.one_hot(top1, router.num_experts).bool(),
                                    float("-inf")).argmax(dim=-1)
    experts = torch.stack([top1, top2], dim=1)
    p = probs.gather(1, experts)
    before = p / p.sum(dim=1, keepdim=True).clamp(min=torch.finfo(p.dtype).eps)
    kept = torch.stack([dispatch1.gather(1, top1[:, None])[:, 0] > 0, combine.gather(1, top2[:, None])[:, 0] > 0], 1)
    # A kept route's weight is what the block combines with; a dropped one's, its gate before dropping.
    weights = torch.where(kept, combine.gather(1, experts), before)
    capacity = [int(router.expert_capacity)] * router.num_experts
    return experts, weights, kept, capacity


FAMILIES = (
    Family("mixtral", ("MixtralTopKRouter",), True, _topk),
    Family("qwen2-moe", ("Qwen2MoeTopKRouter",), True, _topk),
    Family("qwen3-moe", ("Qwen3MoeTopKRouter",), True, _topk),
    Family("olmoe", ("OlmoeTopKRouter",), True, _topk),
    Family("phimoe", ("PhimoeTopKRouter",), True, _topk),
    Family("granitemoe", ("GraniteMoeTopKRouter",), True, _topk),
    Family("gpt-oss", ("GptOssTopKRouter",), True, _topk),
    Family("deepseek-v3", ("DeepseekV3TopkRouter",), True, _deepseek_v3),
    Family("llama4", ("Llama4Router",), True, _llama4),
    Family("switch", ("SwitchTransformersTop1Router",), False, _switch, top_k=1),
    Family("nllb-moe", ("NllbMoeTop2Router",), True, _nllb, top_k=2, padding=True),
)


def _family(router):
    name = type(router).__name__
    return next((f for f in FAMILIES if name in f.classes), None)


def find_router(module):
    """(path, router, family) of the first covered router in module (module itself included)."""
    for path, sub in module.named_modules():
        family = _family(sub)
        if family is not None:
            return path, sub, family
    covered = ", ".join(c for f in FAMILIES for c in f.classes)
    raise TypeError(f"no covered router in {type(module).__name__} (covered: {covered})")


class _Routed(Exception):
    """Raised by the hook once the router has answered: the experts need not run."""


def _gate(router):
    """The router's gate: (weight, bias or None)."""
    linear = getattr(router, "classifier", router)
    return linear.weight, getattr(linear, "bias", None)


def _initialise(router, seed, init):
    weight, bias = _gate(router)
    if init is None:
        # transformers marks the parameters it loaded from a checkpoint.
        loaded = getattr(weight, "_is_hf_initialized", False)
        with torch.no_grad():
            blank = not bool(torch.isfinite(weight).all()) or not bool(weight.any())
        init = blank or not loaded
    if init:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=g) / math.sqrt(weight.shape[1]))
            if bias is not None:
                bias.zero_()


class Router:
    """A wrapped transformers router: ``route(data, mode, seed, padding)`` and the handshake
    attributes (``name``, ``experts``, ``top_k``, ``input``, ``hidden_size``, ``protocol``,
    ``padding_mask``) that ``moe_audit.run``, ``moe_audit.check`` and the snapshot helper read."""

    input = "hidden"

    def __init__(self, module, *, seed=0, init=None, name=None, protocol=v2.PROTOCOL, seed_calls=False):
        path, router, family = find_router(module)
        self.module = module
        self.router = router
        self.family = family
        # The block that holds the router (what a model calls), or the router when given alone.
        self.block = module if router is module else module.get_submodule(path.rpartition(".")[0])
        self.name = name or f"hf-{family.name}"
        self.experts = int(router.num_experts)
        self.top_k = family.k(router)
        self.hidden_size = int(_gate(router)[0].shape[1])
        self.protocol = adapter.protocol_name(protocol)
        # moe-audit/2 sends a padding mask to a router that takes one.
        self.padding_mask = family.padding and self.protocol != v1.PROTOCOL
        self.seed_calls = seed_calls
        _initialise(router, seed, init)
        torch.manual_seed(seed)

    def __repr__(self):
        return (f"moe_audit.hf.Router({type(self.router).__name__} in {type(self.block).__name__}: "
                f"{self.experts} experts, top {self.top_k}, hidden {self.hidden_size})")

    @torch.no_grad()
    def route(self, data, mode, seed=None, padding=None):
        """Routes data [batch, seq_len, hidden] (float32) in mode "train" or "inference"; with
        ``seed_calls``, seeds torch with the request's seed (``moe-audit/2``) first."""
        if self.seed_calls and seed is not None:
            torch.manual_seed(seed)
        self.module.train(mode == "train")
        batch, seq_len, hidden = data.shape
        dtype = _gate(self.router)[0].dtype
        # A copy: blocks scale their input in place (jitter).
        x = torch.tensor(np.asarray(data), dtype=dtype)
        if self.family.flat and self.block is self.router:
            x = x.reshape(batch * seq_len, hidden)
        seen = {}

        def hook(module, args, output):
            seen["x"], seen["out"] = args[0], output
            raise _Routed

        kwargs = {}
        if padding is not None and self.family.padding:
            kwargs["padding_mask"] = torch.from_numpy(np.asarray(padding, dtype=bool).reshape(-1))
        handle = self.router.register_forward_hook(hook)
        try:
            self.block(x, **kwargs)
        except _Routed:
            pass
        finally:
            handle.remove()
        if "out" not in seen:
            raise RuntimeError(f"{type(self.block).__name__} did not call its router")
        experts, weights, kept, capacity = self.family.decode(self.router, seen["x"], seen["out"], batch)
        experts = experts.reshape(batch * seq_len, -1).numpy()
        weights = weights.reshape(batch * seq_len, -1).float().numpy()
        kept = None if kept is None else kept.reshape(batch * seq_len, -1).numpy()
        present = None
        if "padding_mask" in kwargs and not getattr(self.router, "router_ignore_padding_tokens", True):
            # The router masks padding out of both choices: those tokens have no route.
            present = ~kwargs["padding_mask"].numpy()[:, None]
        return adapter.routes_from_arrays(experts, weights, kept, present), capacity

    def run(self, argv=None):
        """Serves the router on stdin/stdout (``moe-audit check --router-cmd``), or with
        ``--answer-plan DIR`` answers a trace plan."""
        adapter.run(self.route, self.name, self.experts, self.top_k, self.input, self.hidden_size,
                    argv=argv, protocol=self.protocol, padding_mask=self.padding_mask)


def wrap(module, *, seed=0, init=None, name=None, protocol=v2.PROTOCOL, seed_calls=False):
    """The router in a transformers module (router, MoE block, or a layer or model holding one),
    ready for ``moe_audit.check``, the snapshot helper, or ``.run()``. See the module docs."""
    return Router(module, seed=seed, init=init, name=name, protocol=protocol, seed_calls=seed_calls)


def run(module, argv=None, **options):
    """``wrap(module, **options).run(argv)``: serves the router to ``moe-audit check
    --router-cmd`` (or answers a trace plan: ``--answer-plan DIR``)."""
    wrap(module, **options).run(argv)

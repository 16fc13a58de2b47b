"""A whole model (token ids in) served to ``moe-audit check`` over ``moe-audit/3``."""

from __future__ import annotations

import inspect
import json
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO, Union

import numpy as np
import torch

from . import wire3
from .capture import Recorder, capture
from .routers import Decoded, Model, NotCovered, discover, module_attribute

#: Every routed layer's routes of a call, and its output rows [T, D] (None: no outputs).
Forward = tuple[dict[int, Decoded], Union[np.ndarray, None]]


def _takes(module: torch.nn.Module, name: str) -> bool:
    """Whether module.forward takes the keyword ``name``."""
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def takes_token_ids(module: torch.nn.Module) -> bool:
    return _takes(module, "input_ids")


def _vocab(module: torch.nn.Module) -> int:
    emb = module_attribute(module, "get_input_embeddings")() if hasattr(module, "get_input_embeddings") else None
    if emb is not None and hasattr(emb, "num_embeddings"):
        return int(emb.num_embeddings)
    v = getattr(getattr(module, "config", None), "vocab_size", None)
    if not v:
        raise NotCovered(f"{type(module).__name__} has no input embeddings and no config.vocab_size: "
                         "the vocabulary size is unknown")
    return int(v)


def _initialise_blank_gates(model: Model, seed: int) -> None:
    """A gate never initialised (torch.empty or zeros: built from a config without init, not
    loaded) gets a seeded normal gate (std 1/sqrt(hidden))."""
    g = torch.Generator().manual_seed(seed)
    for site in model.sites:
        for p in site.module.parameters():
            if p.ndim != 2:
                continue
            with torch.no_grad():
                blank = not bool(torch.isfinite(p).all()) or not bool(p.any())
                if blank:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def _family(module: torch.nn.Module) -> str:
    """The model's family as transformers names it (``config.model_type``), else its class."""
    return getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _config_hint(config: Any) -> str:
    """The config field behind a forward that fails, where a known inconsistency names it."""
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if getattr(config, "kv_lora_rank", None) and heads and kv and kv != heads:
        # MLA expands the latent keys and values to every head, and GQA then repeats them again.
        return (f"; config.num_key_value_heads is {kv} but its MLA attention (kv_lora_rank) expands keys and values "
                f"to all num_attention_heads ({heads}): set num_key_value_heads to {heads}")
    return "; check the config's sizes (num_attention_heads, num_key_value_heads, head_dim, ...)"


def _forward_failure(module: torch.nn.Module, vocab: int, error: BaseException) -> str:
    """One line on a forward that raised while the wrapper looked at the model: the model's own
    forward fails too (its config, named where a known inconsistency says which field), or only
    the wrapper's does."""
    family = _family(module)
    try:
        with torch.no_grad():
            module(input_ids=torch.tensor([[1, 2, 3]]) % vocab)
    except Exception:  # noqa: BLE001 - the config, not the wrapper: said in one line
        return (f"{family}: the model's own forward fails with this config, before any audit "
                f"({_one_line(error)}){_config_hint(getattr(module, 'config', None))}")
    return f"{family}: moe_audit.hf's forward fails where the model's own runs ({_one_line(error)})"


def _repeated_expert(family: str, model: Model, decoded: dict[int, Decoded]) -> str | None:
    """One line on a router that sends a token to one expert twice, if one does: the model
    routes that way (DeepSeek-V4's hash layers look experts up in ``tid2eid``, a table only a
    checkpoint fills: all zeros when built from a config), and a routing record holds an expert
    at most once per token, so such a model is refused, saying why."""
    for site in model.sites:
        d = decoded.get(site.layer)
        if d is None or d.experts.shape[1] < 2:
            continue
        ids = np.where(d.experts >= 0, d.experts, -1 - np.arange(d.experts.shape[1]))
        ordered = np.sort(ids, axis=1)
        twice = np.argwhere(ordered[:, 1:] == ordered[:, :-1])
        if len(twice):
            t, i = (int(x) for x in twice[0])
            why, fix = "", "audit a router that picks distinct experts"
            if hasattr(site.module, "tid2eid"):
                why = (" through its hash table tid2eid (a buffer only a checkpoint fills; config.mlp_layer_types "
                       f"makes layer {site.layer} a hash layer)")
                fix = "load the checkpoint's tid2eid, or fill it with distinct experts per token id"
            return (f"{family}: layer {site.layer} sends token {t} to expert {ordered[t, i]} twice{why}: "
                    "the model routes that way, and moe-audit's routing record holds an expert at most once per "
                    f"token; {fix}")
    return None


class WholeModel:
    """A model taking ``input_ids`` (a ``...ForCausalLM``, a base model, an encoder-decoder whose
    decoder is audited), its routers found by :func:`discover`. ``forward(ids, mode, seed,
    padding, path, prefill)`` returns every routed layer's :class:`Decoded` and the output rows;
    ``serve``/``run`` speak ``moe-audit/3``; ``moe_audit.check(wrap(model))`` audits it here.

    ``outputs``: "hidden" (the final hidden state, default), "logits" (log-probabilities of the
    last layer: vocabulary-wide rows), or None. ``logits``: send each router's logits.
    ``encoder_input_ids``: for an encoder-decoder, the fixed encoder input every call is
    conditioned on (default: 8 tokens 1..8), computed once so only the decoder is audited.
    """

    protocol = wire3.PROTOCOL

    def __init__(self, module: torch.nn.Module, *, seed: int = 0, name: str | None = None,
                 outputs: str | None = "hidden", logits: bool = True, encoder_input_ids: Any = None) -> None:
        if not takes_token_ids(module):
            raise NotCovered(f"{type(module).__name__}.forward takes no input_ids: wrap a model that takes token "
                             "ids (a ...ForCausalLM or a base model), or a router block to audit it on hidden states")
        self.module = module
        self.seed = seed
        self.vocab = _vocab(module)
        self.encoder: torch.Tensor | None = None
        audited = module
        if getattr(getattr(module, "config", None), "is_encoder_decoder", False):
            decoder = module_attribute(module, "get_decoder")()
            audited = decoder
            ids = encoder_input_ids if encoder_input_ids is not None else [list(range(1, 9))]
            encoder = module_attribute(module, "get_encoder")()
            with torch.no_grad():
                self.encoder = encoder(input_ids=torch.as_tensor(ids)).last_hidden_state
        self.model = discover(audited, config=getattr(module, "config", None))
        self._positions = _takes(audited, "position_ids") or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(audited.forward).parameters.values())
        _initialise_blank_gates(self.model, seed)
        if outputs not in ("hidden", "logits", None):
            raise ValueError(f"outputs must be 'hidden', 'logits' or None, got {outputs!r}")
        self.outputs = outputs
        self.name = name or f"hf-{getattr(getattr(module, 'config', None), 'model_type', type(module).__name__)}"
        # One forward finds each router's decoder, whether all routers expose logits, the routes
        # per token of a router that does not say (a capacity router), and the width D. Training
        # mode: an inference call may set state (NLLB-MoE's capacity).
        try:
            probe = self._probe(np.array([[1, 2, 3]]) % self.vocab, seed)
        except NotCovered:
            raise
        except Exception as e:  # noqa: BLE001 - a whole model audits or fails in one line
            raise NotCovered(_forward_failure(module, self.vocab, e)) from e
        repeated = _repeated_expert(_family(module), self.model, probe[0])
        if repeated:
            raise NotCovered(repeated)
        missing = [s.layer for s in self.model.sites if s.layer not in probe[0]]
        if missing:
            raise NotCovered(f"{type(module).__name__}: the routers of layers {missing} did not run in a forward")
        for s in self.model.sites:
            s.top_k = s.top_k or int(probe[0][s.layer].experts.shape[1])
        self.logits = logits and all(d.logits is not None for d in probe[0].values())
        self.width = 0 if probe[1] is None else probe[1].shape[1]
        # The generation path, offered when the model runs it (a KV cache; an encoder has none).
        try:
            self.forward(np.arange(1, 9)[None] % self.vocab, "train", seed, path="generate", prefill=2)
            self.generate, self.no_generate = True, None
        except Exception as e:  # noqa: BLE001 - kept, and the audit runs without G
            self.generate, self.no_generate = False, f"{type(e).__name__}: {e}"
        torch.manual_seed(seed)

    def _probe(self, ids: np.ndarray, seed: int) -> Forward:
        """One forward in training mode. A layer with several routers is audited at its last
        (:func:`discover`); when that one did not run on token ids but another of the layer did
        (a modality-isolated MoE: Ernie 4.5 VL routes text tokens to its text experts, image
        tokens to its vision experts), the one that ran is audited instead, and the forward
        repeated."""
        ran = []
        hooks = [s.module.register_forward_hook(lambda m, a, o, s=s: ran.append(s)) for s in self.model.unaudited or ()]
        try:
            probe = self.forward(ids, "train", seed)
        finally:
            for h in hooks:
                h.remove()
        missing = {s.layer for s in self.model.sites if s.layer not in probe[0]}
        swap = {s.layer: s for s in ran if s.layer in missing}
        if not swap:
            return probe
        m = self.model
        m.unaudited = [s for s in m.unaudited if s not in swap.values()] + [s for s in m.sites if s.layer in swap]
        m.sites = sorted([s for s in m.sites if s.layer not in swap] + list(swap.values()),
                         key=lambda s: (s.kind == "mtp", s.layer))
        _initialise_blank_gates(m, seed)
        return self.forward(ids, "train", seed)

    def handshake(self) -> dict[str, Any]:
        layers = []
        for n, kind in self.model.layers.items():
            entry = {"layer": n, "kind": kind}
            if kind != "dense":
                site = self.model.site(n)
                entry.update(experts=site.experts, top_k=site.top_k)
            layers.append(entry)
        return wire3.handshake(self.name, self.vocab, layers, self.width, self.logits, generate=self.generate)

    @contextmanager
    def _mode(self, mode: str) -> Iterator[None]:
        """The model in training or eval mode, dropout off: the audit compares calls, and dropout
        draws per shape. Dropout modules get p = 0, and so do the float attributes that
        functional dropout reads (``attention_dropout``, ``dropout_rate``, ...), restored after."""
        self.module.train(mode == "train")
        saved = []
        for m in self.module.modules():
            for name, value in vars(m).items():
                if "drop" in name and isinstance(value, float) and value > 0:
                    saved.append((m, name, value))
            if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
                saved.append((m, "p", m.p))
        for m, name, _ in saved:
            setattr(m, name, 0.0)
        try:
            yield
        finally:
            for m, name, value in saved:
                setattr(m, name, value)

    def _call(self, ids: torch.Tensor, mask: torch.Tensor, past: Any = None, use_cache: bool = False,
              start: int = 0) -> Any:
        """One forward of positions start.. of ids; mask covers positions 0.. of the cache too."""
        # Positions count the real tokens before each one (left padding moves none), as generate does.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:start + ids.shape[1]]
        kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": use_cache, "output_hidden_states": True,
                  "position_ids": positions}
        if past is not None:
            # The cache slots given: a cache of linear-attention layers alone cannot say its length.
            kwargs.update(past_key_values=past, cache_position=torch.arange(start, start + ids.shape[1]))
        if self.encoder is not None:
            kwargs["encoder_hidden_states"] = self.encoder.expand(ids.shape[0], -1, -1)
        if not self._positions:
            kwargs.pop("position_ids")  # a model that numbers positions itself (sinusoidal from the ids)
        return self.model.root(**kwargs)

    def _rows(self, out: Any) -> np.ndarray | None:
        if self.outputs is None:
            return None
        x: torch.Tensor | None
        if self.outputs == "logits" and getattr(out, "logits", None) is not None:
            x = torch.log_softmax(out.logits.float(), dim=-1)
        else:
            hs = getattr(out, "hidden_states", None)
            x = hs[-1] if hs else getattr(out, "last_hidden_state", None)
            if x is None:
                return None
        return x.float().reshape(-1, x.shape[-1]).numpy()

    @torch.no_grad()
    def forward(self, ids: Any, mode: str = "train", seed: int | None = None, padding: Any = None,
                path: str = "forward", prefill: int = 0) -> Forward:
        """({layer: Decoded}, output rows [T, D] or None) of token ids [batch, seq_len]."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.size == 0:
            raise ValueError(f"token ids must be a non-empty [batch, seq_len] array, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"token ids must be integers, got {ids.dtype} (a model without a tokenizer takes ids, "
                            "not text)")
        if ids.min() < 0 or ids.max() >= self.vocab:
            raise ValueError(f"token ids must be from 0 to {self.vocab - 1} (the vocabulary), got {ids.min()} to "
                             f"{ids.max()}")
        torch.manual_seed(self.seed if seed is None else seed)
        x = torch.as_tensor(ids, dtype=torch.long)
        mask = torch.ones_like(x) if padding is None else torch.as_tensor(~np.asarray(padding, dtype=bool)).long()
        with self._mode(mode), capture(self.model) as rec:
            if path == "forward":
                out = self._call(x, mask)
                return rec.calls[-1], self._rows(out)
            return self._generate(rec, x, mask, max(prefill, 1))

    def _generate(self, rec: Recorder, x: torch.Tensor, mask: torch.Tensor, prefill: int) -> Forward:
        """Prefill the first positions in one forward, then one token at a time through the
        KV cache (teacher-forced), every step recorded; returned in forward's layout."""
        b, s = x.shape
        out = self._call(x[:, :prefill], mask[:, :prefill], use_cache=True)
        past = getattr(out, "past_key_values", None)
        if past is None:
            raise NotCovered(f"{type(self.module).__name__} returns no KV cache: it has no generation path")
        rows = [self._rows(out)]
        for t in range(prefill, s):
            out = self._call(x[:, t:t + 1], mask[:, :t + 1], past=past, use_cache=True, start=t)
            past = out.past_key_values
            rows.append(self._rows(out))
        steps = [prefill] + [1] * (s - prefill)
        layers: dict[int, Decoded] = {}
        for n in rec.calls[0]:
            parts = [call[n] for call in rec.calls]
            layers[n] = _interleave(parts, steps, b)
        outputs = None if rows[0] is None else _interleave_rows([r for r in rows if r is not None], steps, b)
        return layers, outputs

    def serve(self, stdin: BinaryIO | None = None, stdout: BinaryIO | None = None) -> None:
        """Speaks moe-audit/3 on binary streams (default stdin/stdout) until the input closes."""
        inp = stdin or sys.stdin.buffer
        out = stdout or sys.stdout.buffer
        hs = self.handshake()
        out.write(json.dumps(hs).encode() + b"\n")
        out.flush()
        user_out = sys.stdout
        if stdout is None:
            sys.stdout = sys.stderr
        try:
            while (req := wire3.read_request(inp, self.vocab)) is not None:
                if req.path == "generate" and not self.generate:
                    raise ValueError(f"request {req.id}: the generation path was not offered ({self.no_generate})")
                layers, rows = self.forward(req.ids, req.mode, req.seed, req.padding, req.path, req.prefill)
                missing = [s.layer for s in self.model.sites if s.layer not in layers]
                if missing:
                    raise RuntimeError(f"request {req.id}: the routers of layers {missing} did not run")
                routed = [(s.layer, (layers[s.layer], s.experts)) for s in self.model.sites]
                header, payload = wire3.response(req.id, routed, rows if self.width else None, self.logits)
                out.write(header)
                out.write(payload)
                out.flush()
        finally:
            sys.stdout = user_out

    def run(self, argv: Sequence[str] | None = None) -> None:
        """Serves the model on stdin/stdout (``moe-audit model --cmd``). ``argv``: this
        wrapper's arguments (it takes none); None leaves the script's command line to the script."""
        if argv:
            sys.exit(f"usage: {sys.argv[0]} (serves {wire3.PROTOCOL} on stdin/stdout)")
        self.serve()


def _interleave(parts: list[Decoded], steps: list[int], batch: int) -> Decoded:
    """Decoded of the steps of a generation ([batch * step] tokens each) in forward's layout."""

    def join(name: str) -> Any:
        arrays = [getattr(p, name) for p in parts]
        if any(a is None for a in arrays):
            return None
        per = [a.reshape(batch, n, *a.shape[1:]) for a, n in zip(arrays, steps)]
        cat = np.concatenate(per, axis=1)
        return cat.reshape(-1, *cat.shape[2:])

    # A capacity router's capacity is the prefill's (each step has its own).
    return Decoded(join("experts"), join("weights"), join("kept"), join("logits"), parts[0].capacity)


def _interleave_rows(rows: list[np.ndarray], steps: list[int], batch: int) -> np.ndarray:
    per = [r.reshape(batch, n, -1) for r, n in zip(rows, steps)]
    cat = np.concatenate(per, axis=1)
    return cat.reshape(-1, cat.shape[-1])

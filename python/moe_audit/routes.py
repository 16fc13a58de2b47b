"""Record every router of a Hugging Face model in moe-audit's routing record format.

::

    import moe_audit.routes
    rec = moe_audit.routes.record(model, input_ids, "trainer.safetensors")             # one forward
    rec = moe_audit.routes.record(model, input_ids, "engine.safetensors", generate=True)  # KV-cache decode

then ``moe-audit routes compare engine.safetensors trainer.safetensors --config config.json``.

The file is ``moe-audit-routes/1`` (docs/ROUTES.md): ``experts`` int32 ``[tokens, layers, top_k]``
(-1 = no route: padding), ``logits`` float32 ``[tokens, layers, experts]``, ``input_ids`` and
``cu_seqlens`` (one sequence per batch row, sequence-major), and metadata: ``format``,
``layers`` (the global numbers of axis 1), ``source`` (``hf-forward`` or ``hf-generate``),
``dtype`` (the router's parameters) and ``mode`` (``train`` or ``eval``).

Routers are found with ``moe_audit.hf.discover`` when it is there (every router, MoE and MTP
layers numbered globally); otherwise by forward hooks on the top-k routers of the families this
module knows (``Qwen3MoeTopKRouter`` and its relatives that return ``(logits, weights, indices)``
and live at ``...layers.N.mlp.gate``).

``generate=True`` records as an inference engine does: the first ``prefill`` positions in one
forward with a KV cache, then every later given token fed one at a time through the cache
(teacher-forced decoding), so each position is routed by the decode path. Nothing is sampled:
the tokens are the ones given, so both records cover the same tokens.
"""

import json
import re
import struct

import numpy as np
import torch

FORMAT = "moe-audit-routes/1"


def _sites(model):
    """[(global layer, module, decode)] for every router: decode(inputs, output) -> (ids [T, k], logits [T, E] or None)."""
    try:
        from . import hf

        discover = getattr(hf, "discover", None)
    except ImportError:  # pragma: no cover - torch present, transformers absent
        discover = None
    if discover is not None:
        found = discover(model)

        def decoder(site):
            def decode(inputs, output):
                d = site.decode(inputs, output)
                return np.asarray(d.experts, dtype=np.int32), None if d.logits is None else np.asarray(d.logits, np.float32)

            return decode

        return [(s.layer, s.module, decoder(s)) for s in found.sites]
    sites = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("TopKRouter"):
            continue
        m = re.search(r"layers\.(\d+)\.", name)
        if m is None:
            continue

        def decode(inputs, output):
            logits, _, indices = output
            return (
                indices.detach().reshape(-1, indices.shape[-1]).to(torch.int32).cpu().numpy(),
                logits.detach().reshape(-1, logits.shape[-1]).float().cpu().numpy(),
            )

        sites.append((int(m.group(1)), module, decode))
    if not sites:
        raise TypeError(
            f"{type(model).__name__}: no router found (moe_audit.hf.discover is not available and no "
            "`*TopKRouter` module sits under `layers.N`)"
        )
    return sorted(sites, key=lambda s: s[0])


class _Capture:
    """Forward hooks on every router; each call of a router appends (ids, logits) to its list."""

    def __init__(self, sites):
        self.sites = sites
        self.calls = {layer: [] for layer, _, _ in sites}
        self.handles = []

    def __enter__(self):
        for layer, module, decode in self.sites:

            def hook(_module, inputs, output, layer=layer, decode=decode):
                self.calls[layer].append(decode(inputs, output))

            self.handles.append(module.register_forward_hook(hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _stack(calls, batch, steps):
    """Router calls (each [batch * len_i, k], sequence-major within the call) as [batch, seq, k]."""
    parts = [c.reshape(batch, n, *c.shape[1:]) for c, n in zip(calls, steps)]
    return np.concatenate(parts, axis=1)


def record(model, input_ids, path=None, *, mode="train", attention_mask=None, generate=False, prefill=1, logits=True):
    """Records every router of ``model`` on ``input_ids`` ([batch, seq] or [seq]).

    ``mode``: ``"train"`` (``model.train()``, as a trainer's forward) or ``"eval"``; the model is
    left in that mode. ``attention_mask`` (1 = token, 0 = padding): padding rows are written as
    -1 (no route). ``generate``: KV-cache decoding after ``prefill`` positions instead of one
    forward. ``logits``: keep the router logits. Writes ``path`` when given; returns the arrays
    and metadata as a dict either way.
    """
    if mode not in ("train", "eval"):
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"input_ids must be [batch, seq] token ids, got shape {tuple(ids.shape)}")
    batch, seq = ids.shape
    mask = None if attention_mask is None else torch.as_tensor(attention_mask).reshape(batch, seq)
    sites = _sites(model)
    model.train(mode == "train")
    device = next(model.parameters()).device
    ids = ids.to(device)
    steps = []
    with torch.no_grad(), _Capture(sites) as cap:
        if not generate:
            model(input_ids=ids, attention_mask=None if mask is None else mask.to(device), use_cache=False)
            steps.append(seq)
        else:
            if not 1 <= prefill <= seq:
                raise ValueError(f"prefill must be in 1..{seq}, got {prefill}")
            m = None if mask is None else mask.to(device)
            out = model(input_ids=ids[:, :prefill], attention_mask=None if m is None else m[:, :prefill], use_cache=True)
            steps.append(prefill)
            past = out.past_key_values
            for t in range(prefill, seq):
                out = model(
                    input_ids=ids[:, t : t + 1],
                    attention_mask=None if m is None else m[:, : t + 1],
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                steps.append(1)
    layers = [layer for layer, _, _ in sites]
    experts, router_logits = [], []
    for layer in layers:
        calls = cap.calls[layer]
        if len(calls) != len(steps):
            raise RuntimeError(f"layer {layer}: {len(calls)} router calls for {len(steps)} forwards")
        experts.append(_stack([c[0] for c in calls], batch, steps))
        if logits and all(c[1] is not None for c in calls):
            router_logits.append(_stack([c[1] for c in calls], batch, steps))
    e = np.stack(experts, axis=2).reshape(batch * seq, len(layers), -1).astype(np.int32)
    arrays = {"experts": e}
    if len(router_logits) == len(layers):
        arrays["logits"] = np.stack(router_logits, axis=2).reshape(batch * seq, len(layers), -1).astype(np.float32)
    if mask is not None:
        pad = mask.reshape(-1).cpu().numpy() == 0
        arrays["experts"][pad] = -1
        if "logits" in arrays:
            arrays["logits"][pad] = 0.0
    arrays["input_ids"] = ids.reshape(-1).cpu().numpy().astype(np.int64)
    arrays["cu_seqlens"] = np.arange(batch + 1, dtype=np.int64) * seq
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    metadata = {
        "format": FORMAT,
        "layers": json.dumps(layers),
        "source": "hf-generate" if generate else "hf-forward",
        "dtype": dtype,
        "mode": mode,
    }
    if path is not None:
        save(path, arrays, metadata)
    return {"arrays": arrays, "metadata": metadata}


_DTYPES = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.float32): "F32"}


def save(path, arrays, metadata):
    """Writes ``arrays`` (int32, int64 or float32 numpy arrays) and string ``metadata`` as a
    safetensors file (numpy alone)."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    offset = 0
    blobs = []
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        if a.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {a.dtype} is not int32, int64 or float32")
        blob = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{path}.partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    import os

    os.replace(tmp, path)

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

Routers are found by ``moe_audit.hf.discover`` (every router of every covered family, MoE and
MTP layers numbered globally) and recorded by ``moe_audit.hf.capture`` (one ``{layer: Decoded}``
per forward of the model).

``generate=True`` records as an inference engine does: the first ``prefill`` positions in one
forward with a KV cache, then every later given token fed one at a time through the cache
(teacher-forced decoding), so each position is routed by the decode path. Nothing is sampled:
the tokens are the ones given, so both records cover the same tokens.
"""

import json
import os
import struct

import numpy as np
import torch

FORMAT = "moe-audit-routes/1"


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
    from . import hf

    found = hf.discover(model)
    model.train(mode == "train")
    device = next(model.parameters()).device
    ids = ids.to(device)
    steps = []
    with torch.no_grad(), hf.capture(found) as cap:
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
    layers = [site.layer for site in found.sites]
    if len(cap.calls) != len(steps):
        raise RuntimeError(f"{len(cap.calls)} recorded forwards for {len(steps)} calls of the model")
    experts, router_logits = [], []
    for layer in layers:
        missing = [i for i, call in enumerate(cap.calls) if layer not in call]
        if missing:
            raise RuntimeError(f"layer {layer}: no routes in forward {missing[0]}")
        decoded = [call[layer] for call in cap.calls]
        experts.append(_stack([np.asarray(d.experts, dtype=np.int32) for d in decoded], batch, steps))
        if logits and all(d.logits is not None for d in decoded):
            router_logits.append(_stack([np.asarray(d.logits, dtype=np.float32) for d in decoded], batch, steps))
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
    os.replace(tmp, path)

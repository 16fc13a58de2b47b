"""Record every router of a Hugging Face model in moe-audit's routing record format.

::

    import moe_audit.routes
    rec = moe_audit.routes.record(model, input_ids, "trainer.safetensors")             # one forward
    rec = moe_audit.routes.record(model, input_ids, "engine.safetensors", generate=True)  # KV-cache decode

then ``moe-audit routes compare engine.safetensors trainer.safetensors --config config.json``,
or in this process, without files (the training loop's check, docs/ROUTES.md "Inside the
training loop")::

    rec = moe_audit.routes.record(model, input_ids)              # arrays, no file
    c = moe_audit.routes.compare(engine_routes, rec, config=model.config.to_dict(),
                                 max_disagreement=0.0)
    wandb.log(c.metrics())
    if c.failed: raise SystemExit(c.diagnoses[0]["found"])

:func:`compare` takes each side as a file, an integer array ``[tokens, layers, top_k]`` (numpy,
or a CPU torch tensor; read in place, not copied), a list of per-sequence arrays, the dict
:func:`record` returns, or :func:`router_replay` of Megatron-Core's ``RouterReplay`` instances.

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

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .errors import MoeAuditError

if TYPE_CHECKING:
    import torch

FORMAT = "moe-audit-routes/1"


def _stack(calls: list[np.ndarray], batch: int, steps: list[int]) -> np.ndarray:
    """Router calls (each [batch * len_i, k], sequence-major within the call) as [batch, seq, k]."""
    parts = [c.reshape(batch, n, *c.shape[1:]) for c, n in zip(calls, steps)]
    return np.concatenate(parts, axis=1)


def record(model: torch.nn.Module, input_ids: torch.Tensor | npt.ArrayLike,
           path: str | os.PathLike[str] | None = None, *, mode: str = "train",
           attention_mask: torch.Tensor | npt.ArrayLike | None = None, generate: bool = False, prefill: int = 1,
           logits: bool = True) -> dict[str, Any]:
    """Records every router of ``model`` on ``input_ids`` ([batch, seq] or [seq]).

    ``mode``: ``"train"`` (``model.train()``, as a trainer's forward) or ``"eval"``; the model is
    left in that mode. ``attention_mask`` (1 = token, 0 = padding): padding rows are written as
    -1 (no route). ``generate``: KV-cache decoding after ``prefill`` positions instead of one
    forward. ``logits``: keep the router logits. Writes ``path`` when given; returns the arrays
    and metadata as a dict either way.
    """
    import torch

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
            head = None if m is None else m[:, :prefill]
            out = model(input_ids=ids[:, :prefill], attention_mask=head, use_cache=True)
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
    arrays: dict[str, np.ndarray] = {"experts": e}
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


def save(path: str | os.PathLike[str], arrays: dict[str, np.ndarray], metadata: dict[str, Any]) -> None:
    """Writes ``arrays`` (int32, int64 or float32 numpy arrays) and string ``metadata`` as a
    safetensors file (numpy alone)."""
    header: dict[str, Any] = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
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


class RoutesError(MoeAuditError, ValueError):
    """Bad input to :func:`compare`: the message is the line ``moe-audit routes compare`` prints
    after ``error:`` for the same input."""


class Comparison:
    """A rollout record against a trainer record, as ``moe-audit routes compare --format json``
    reports it: ``failed`` (a defect, or disagreement over ``max_disagreement``),
    ``diagnoses`` (defects first: ``kind``, ``defect``, ``found``, ``change``), ``measures``
    (``decisions_differ``, ``tokens_differ``, ``layers``, ...); :meth:`to_dict` is the whole
    document, :meth:`metrics` a flat dict of floats to log."""

    def __init__(self, document: dict[str, Any]) -> None:
        self._document = document
        self.failed = bool(document["failed"])
        self.diagnoses = document["diagnoses"]
        self.measures = document["measures"]

    @property
    def exit_code(self) -> int:
        """The command's exit code for this result: 1 failed, else 0."""
        return int(self.failed)

    @property
    def defects(self) -> list[dict[str, Any]]:
        """The diagnoses that are defects."""
        return [d for d in self.diagnoses if d["defect"]]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document ``moe-audit routes compare --format json`` prints (a copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self._document))
        return copy

    def metrics(self, prefix: str = "r3/") -> dict[str, float]:
        """Flat ``{name: float}`` for W&B or TensorBoard: ``decisions_differ`` and
        ``tokens_differ`` (shares 0..1), ``overlap``, ``tokens``, ``decisions``, ``missing``,
        ``order_only``, ``failed``, ``defects``, per defect kind ``defect/KIND`` (counts), and per
        compared layer ``layer/N/decisions_differ`` (N: the trainer's global layer number)."""
        m = self.measures
        keys = ("decisions_differ", "tokens_differ", "overlap", "tokens", "decisions", "missing", "order_only")
        out = {prefix + key: float(m[key]) for key in keys}
        if m.get("mean_first_differing") is not None:
            out[prefix + "mean_first_differing"] = float(m["mean_first_differing"])
        out[prefix + "failed"] = float(self.failed)
        out[prefix + "defects"] = float(len(self.defects))
        for d in self.defects:
            key = f"{prefix}defect/{d['kind']}"
            out[key] = out.get(key, 0.0) + 1.0
        for layer in m["layers"]:
            out[f"{prefix}layer/{layer['trainer']}/decisions_differ"] = float(layer["differ"])
        return out

    def __repr__(self) -> str:
        m = self.measures
        return (
            f"<Comparison failed={self.failed} decisions_differ={m['decisions_differ']:.4g} "
            f"tokens_differ={m['tokens_differ']:.4g} defects={len(self.defects)}>"
        )


#: One array as the extension reads it: (its data's address, size in bytes, dtype name, shape).
Part = tuple[int, int, str, tuple[int, int, int]]


def _part(a: Any, what: str) -> tuple[np.ndarray, Part]:
    """One array as (the array, its data's address and size, dtype name, shape): read in place
    when it is C-contiguous and little-endian (numpy arrays, np.memmap, CPU torch tensors); the
    array is held by the caller for the call."""
    # torch only when given one: `import moe_audit` (and the `moe-audit` script) stays torch-free.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise RoutesError(f"{what}: a tensor on {a.device}: move it to the CPU first (.cpu())")
        a = a.detach()
        if a.is_floating_point() or a.is_complex() or a.dtype == torch.bool:
            raise RoutesError(f"{what}: dtype {str(a.dtype).replace('torch.', '')}: expert ids must be integers")
        a = a.contiguous().numpy()
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise RoutesError(f"{what}: dtype {a.dtype}: expert ids must be integers")
    if a.ndim != 3:
        raise RoutesError(f"{what}: shape {list(a.shape)}: expert ids are [tokens, layers, top_k]")
    if a.dtype.byteorder == ">" or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    tokens, layers, top_k = (int(n) for n in a.shape)
    return a, (a.__array_interface__["data"][0], a.nbytes, a.dtype.name, (tokens, layers, top_k))


def _side(x: Any, role: str) -> tuple[list[np.ndarray], str | tuple[str, list[Part], list[int] | None]]:
    """A side of :func:`compare` as the extension takes it: a path, or (name, parts, layers)."""
    if isinstance(x, (str, os.PathLike)):
        return [], os.fspath(x)
    layers = None
    if isinstance(x, dict):
        # record()'s {"arrays", "metadata"}, or router_replay()'s {"experts", "layers"}.
        if "arrays" in x:
            layers = json.loads(x.get("metadata", {}).get("layers", "null"))
            x = x["arrays"]
        if "experts" not in x:
            raise RoutesError(f"{role}: a dict record holds `experts` (and `layers`), got keys {sorted(x)}")
        layers = x.get("layers", layers)
        cu = x.get("cu_seqlens")
        x = x["experts"]
        if cu is not None:
            # One part per sequence, as the file format keeps them (row slices: views, no copy).
            cu = [int(c) for c in np.asarray(cu)]
            x = [x[a:b] for a, b in zip(cu[:-1], cu[1:])]
    arrays = list(enumerate(x)) if isinstance(x, (list, tuple)) else [(None, x)]
    read = [_part(a, role if i is None else f"{role} sequence {i}") for i, a in arrays]
    held = [p[0] for p in read]
    parts = [p[1] for p in read]
    sequences = f", {len(parts)} sequences" if len(parts) > 1 else ""
    name = f"{role} ({parts[0][2]} {'x'.join(str(n) for n in parts[0][3])}{sequences})" if parts else role
    return held, (name, parts, None if layers is None else [int(g) for g in layers])


def compare(rollout: Any, trainer: Any, *, config: str | os.PathLike[str] | dict[str, Any] | None = None,
            max_disagreement: float | None = None, max_memory: str | None = None) -> Comparison:
    """``moe-audit routes compare`` in this process, no subprocess and no file: returns a
    :class:`Comparison`; bad input raises :class:`RoutesError` with the command's message.

    ``rollout`` (the engine's) and ``trainer``: each a record file (any format the command
    reads), an integer array ``[tokens, layers, top_k]`` (numpy, np.memmap or a CPU torch
    tensor, any integer dtype, -1 = no route; read in place), a list of them (one per sequence),
    the dict :func:`record` returns, or :func:`router_replay`'s. ``config``: the model's
    config.json path, or its dict (``model.config.to_dict()``). ``max_disagreement``: fail over
    this share of differing decisions (0: a replay check). ``max_memory``: as ``--max-memory``
    (``"4GiB"``). The comparison runs without the GIL.
    """
    from . import _native

    if isinstance(config, (str, os.PathLike)) or config is None:
        config_path, config_json = (None if config is None else os.fspath(config)), None
    elif isinstance(config, dict):
        config_path, config_json = None, json.dumps(config, default=str)
    else:
        raise RoutesError(f"config: a config.json path or its dict, got {type(config).__name__}")
    if max_disagreement is not None:
        max_disagreement = float(max_disagreement)
    if max_memory is not None:
        max_memory = str(max_memory)
    # The arrays (held, maybe made contiguous) stay referenced here while the extension reads them.
    held_r, r = _side(rollout, "rollout")
    held_t, t = _side(trainer, "trainer")
    ok, text = _native.compare(r, t, config_path, config_json, max_disagreement, max_memory)
    del held_r, held_t
    if not ok:
        raise RoutesError(text)
    return Comparison(json.loads(text))


def router_replay(instances: Iterable[Any] | None = None, *, model: torch.nn.Module | None = None,
                  layers: Sequence[int] | None = None) -> dict[str, Any]:
    """The routes Megatron-Core's ``RouterReplay`` recorded in this process, for :func:`compare`:
    ``{"experts": [tokens, layers, top_k], "layers": [...]}``.

    ``instances``: the ``RouterReplay`` objects (default: ``RouterReplay.global_router_replay_instances``,
    one per MoE layer in instantiation order), each holding ``recorded_topk_idx``
    ``[tokens, top_k]`` after a forward with ``RouterReplayAction.RECORD``. Layer numbers:
    ``layers`` when given, else from ``model`` (each router's ``layer_number``, 1-based global,
    as 0-based decoder indices), else 0 to N-1 (the MoE layers in order).
    """
    if instances is None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        instances = RouterReplay.global_router_replay_instances
    instances = list(instances)
    if not instances:
        raise RoutesError("no RouterReplay instances: build the model with moe_enable_routing_replay=True")
    idx = [r.recorded_topk_idx for r in instances]
    missing = [i for i, t in enumerate(idx) if t is None]
    if missing:
        raise RoutesError(
            f"RouterReplay instance {missing[0]} recorded nothing: set RouterReplayAction.RECORD before the forward"
        )
    if layers is None and model is not None:
        by_replay = {
            id(m.router_replay): m.layer_number
            for m in model.modules()
            if getattr(m, "router_replay", None) is not None
        }
        # Megatron's layer_number: an int attribute (torch types a module's attributes loosely).
        numbers: list[Any] = [by_replay.get(id(r)) for r in instances]
        if all(n is not None for n in numbers):
            layers = [n - 1 for n in numbers]
    import torch

    experts = torch.stack([t.detach().reshape(t.shape[0], -1) for t in idx], dim=1).cpu()
    return {"experts": experts, "layers": layers}

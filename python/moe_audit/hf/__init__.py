"""Audit Hugging Face ``transformers`` MoE models: whole models on token ids, or one router block
on hidden states.

::

    import moe_audit, moe_audit.hf
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", num_hidden_layers=4))
    moe_audit.check(moe_audit.hf.wrap(model))   # or moe_audit.hf.run(model): serve it to moe-audit

Routers are found by structure (:func:`discover`): a gate projection to E experts beside an
experts container, in any module; each is decoded into routes with kept flags and capacity, and
numbered by its decoder layer. A model taking ``input_ids`` is served over ``moe-audit/3``
(:class:`WholeModel`); a router or an MoE block alone is served over ``moe-audit/2`` on hidden
states (:class:`Router`). :func:`capture` records every router's decisions during forwards.
Needs torch and transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .block import FAMILIES, Family, Router, find_router
from .capture import Recorder, capture
from .model import WholeModel, takes_token_ids
from .routers import Decoded, Model, NotCovered, Site, discover, register_decoder, unregister_decoder


def wrap(module: torch.nn.Module, **options: Any) -> WholeModel | Router:
    """A model taking token ids -> :class:`WholeModel` (``moe-audit/3``); a router, an MoE block
    or a layer -> :class:`Router` (``moe-audit/2``, hidden states in)."""
    if takes_token_ids(module):
        return WholeModel(module, **options)
    return Router(module, **options)


def run(module: torch.nn.Module, argv: Sequence[str] | None = None, **options: Any) -> None:
    """``wrap(module, **options).run(argv)``: serves it to ``moe-audit check --router-cmd``."""
    wrap(module, **options).run(argv)


__all__ = ["FAMILIES", "Decoded", "Family", "Model", "NotCovered", "Recorder", "Router", "Site", "WholeModel",
           "capture", "discover", "find_router", "register_decoder", "run", "unregister_decoder", "wrap"]

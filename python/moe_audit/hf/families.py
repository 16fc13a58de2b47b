"""The MoE families of the installed transformers, each built as a tiny random model (no download).

A family is a model directory of transformers whose modeling code routes tokens to experts (a
config field naming an expert count). :func:`build` makes its causal language model (or its
text model, or the decoder of an encoder-decoder) from the family's default config shrunk to
hidden 64, 4 layers, 8 experts, top 2, vocabulary 512, seeded random weights. Sizes are shrunk by
field name; those the default derives from others stay derived (an MLA head_dim that is
qk_nope + qk_rope, a multimodal RoPE's sections that sum to the rotary half-dim, a sub-config's
hidden size another one must match); a family that needs more has a setting of its own
(:data:`SETTINGS`, :data:`FIXES`), each with why.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from .routers import EXPERT_FIELDS, TOP_K_FIELDS

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

HIDDEN = 64
LAYERS = 4
EXPERTS = 8
TOP_K = 2
VOCAB = 512

#: Config fields shrunk on every config (and sub-config), by name.
_SIZES = (
    (HIDDEN, ("hidden_size", "d_model", "n_embd", "dim")),
    (32, ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "d_ff",
         "expert_intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "moe_ffn_hidden_size",
         "dense_intermediate_size", "expert_ffn_hidden_size", "shared_intermediate_size", "mlp_hidden_size",
         "intermediate_size_mlp", "moe_shared_expert_intermediate_size", "kv_channels",
         "shared_experts_intermediate_size")),
    (LAYERS, ("num_hidden_layers", "n_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers",
             "num_decoder_layers")),
    (4, ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
        "linear_num_value_heads", "mamba_n_heads", "num_heads", "linear_num_heads")),
    (2, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "linear_num_key_heads", "n_group", "n_groups",
        "mamba_n_groups", "num_experts_per_group", "num_expert_group")),
    (1, ("topk_group", "first_k_dense_replace", "num_shared_experts", "n_shared_experts", "moe_num_shared_experts",
        "num_nextn_predict_layers", "zero_expert_num", "num_dense_layers")),
    (16, ("head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "linear_key_head_dim", "linear_value_head_dim",
         "mamba_head_dim", "ssm_state_size", "qk_rope_head_dim", "mamba_d_state", "attention_head_dim",
         "global_head_dim", "index_head_dim", "d_kv", "linear_head_dim")),
    (8, ("rotary_dim", "index_n_heads")),
    (32, ("q_lora_rank",)),
    (EXPERTS, EXPERT_FIELDS),
    (TOP_K, TOP_K_FIELDS),
    (VOCAB, ("vocab_size",)),
)
_FIELD_SIZE = {f: v for v, fields in _SIZES for f in fields}
_TOKEN_IDS = re.compile(r".*_token_id$|.*_token_ids$")


def families() -> dict[str, str]:
    """{family: model_type} of every MoE family in the installed transformers, sorted."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out: dict[str, list[str]] = {}
    for model_type, cls in CONFIG_MAPPING_NAMES.items():
        family = _family_of(model_type)
        if family is None:
            continue
        try:
            config = getattr(transformers, cls)()
        except Exception:  # noqa: BLE001 - a config that cannot be built with defaults is not listed here
            continue
        if _routed(config):
            out.setdefault(family, []).append(model_type)
    return {f: _pick(f, types) for f, types in sorted(out.items())}


def _family_of(model_type: str) -> str | None:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    try:
        spec = importlib.util.find_spec(f"transformers.models.{module}")
    except (ImportError, ValueError):
        return None
    return module if spec is not None else None


def _routed(config: Any, depth: int = 0) -> bool:
    for k, v in vars(config).items():
        if k in EXPERT_FIELDS and isinstance(v, int) and v > 1:
            return True
        if k in ("text_config", "ffn_config") and depth < 2 and v is not None and hasattr(v, "__dict__"):
            if _routed(v, depth + 1):
                return True
    return False


def _pick(family: str, types: list[str]) -> str:
    """The model type whose model takes token ids: one with a causal LM, else a *_text one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal

    ranked = sorted(types, key=lambda t: (t not in causal, not t.endswith("_text"), t != family, len(t), t))
    return ranked[0]


#: A config as a dict (``to_dict()``), and its sub-configs as dicts.
ConfigDict = dict[str, Any]


def shrink(d: ConfigDict, depth: int = 0, base: tuple[ConfigDict, ConfigDict] | None = None) -> ConfigDict:
    """A config dict shrunk: sizes by field name, per-layer lists cut to LAYERS, token ids in
    the vocabulary, derived sizes kept consistent (:func:`_keep_ties`). ``base``: (before,
    after) of the config a per-layer override dict belongs to."""
    layers = next((d[f] for f, v in _FIELD_SIZE.items()
                   if v == LAYERS and "layer" in f and isinstance(d.get(f), int)), None)
    if layers is None:  # no layer count: the layers are the entries of the per-layer types (NemotronH)
        layers = max((len(v) for k, v in d.items()
                      if isinstance(v, list) and re.fullmatch(r"layers?_\w*types?", str(k))), default=None)
    out: ConfigDict = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
            v = {i: x for i, x in v.items() if int(i) < LAYERS}  # per-layer settings (shrunk below)
        elif isinstance(v, dict) and depth < 3:
            v = shrink(v, depth + 1)
        elif k in TOP_K_FIELDS and v is None and any(isinstance(d.get(f), int) for f in EXPERT_FIELDS):
            v = TOP_K
        elif k == "mlp_layer_types" and v is None and any(isinstance(d.get(f), int) for f in EXPERT_FIELDS):
            # left to the checkpoint, and indexed per layer: the usual dense first layer, then MoE
            v = ["dense"] + ["sparse"] * (LAYERS - 1)
        elif k in _FIELD_SIZE and isinstance(v, int) and not isinstance(v, bool) and v > 0:
            v = min(v, _FIELD_SIZE[k]) if k == "topk_group" else _FIELD_SIZE[k]
        elif _TOKEN_IDS.match(str(k)) and isinstance(v, int) and v >= VOCAB:
            v = VOCAB - 1
        elif isinstance(v, (list, str)) and layers and len(v) == layers and layers > LAYERS:
            cut = v[:LAYERS]
            full = [x for x in v if str(x) in ("attention", "full_attention")] if isinstance(v, list) else []
            if full and isinstance(cut, list) and full[0] not in cut:
                # keep one attention layer, so the KV cache has one to measure (generation path)
                cut = cut[:-1] + full[:1]
            v = cut
        out[k] = v
    if d.get("num_key_value_heads") == d.get("num_attention_heads") and "num_attention_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # multi-head (MLA): keep kv = heads
    _keep_ties(d, out, base)
    for k, v in out.items():
        if isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
            # each layer's overrides shrunk like its config, over the config's own values
            out[k] = {i: shrink(x, depth + 1, base=(d, out)) if isinstance(x, dict) else x for i, x in v.items()}
    return out


def _keep_ties(before: ConfigDict, after: ConfigDict, base: tuple[ConfigDict, ConfigDict] | None = None) -> None:
    """Sizes the default config derives from others stay derived once those are shrunk, in
    ``after`` (a per-layer override: merged over its config's, ``base``):

    - ``head_dim`` (and ``qk_head_dim``) that is ``qk_nope_head_dim + qk_rope_head_dim`` (MLA);
    - ``<part>_hidden_size`` that is the hidden size of the sibling ``<part>_config`` (a
      validator ties them).
    """
    if base is not None:
        eff_before, eff_after = {**base[0], **before}, {**base[1], **after}
    else:
        eff_before, eff_after = before, after
    parts = [eff_before.get(f) for f in ("qk_nope_head_dim", "qk_rope_head_dim")]
    sizes = [x for x in parts if isinstance(x, int) and not isinstance(x, bool)]
    if len(sizes) == len(parts) and sum(sizes) > 0:
        tied = eff_after["qk_nope_head_dim"] + eff_after["qk_rope_head_dim"]
        for f in ("head_dim", "qk_head_dim"):
            if eff_before.get(f) == sum(sizes) and eff_after.get(f) != tied:
                after[f] = tied
    # <part>_hidden_size beside <part>_config, in this config or in one of its sub-configs
    for where_before, where_after in [(before, after)] + [
            (v, after[k]) for k, v in before.items() if isinstance(v, dict) and isinstance(after.get(k), dict)]:
        for k, v in where_before.items():
            if not str(k).endswith("_hidden_size"):
                continue
            part = k[: -len("_hidden_size")] + "_config"
            sub = before.get(part)
            if (isinstance(v, int) and isinstance(sub, dict) and sub.get("hidden_size") == v
                    and isinstance(after.get(part), dict)):
                where_after[k] = after[part]["hidden_size"]


#: What a family's shrunk config needs before it builds in transformers 5.23: fields set when
#: the config is made (a constraint of the family), or a fix applied after (a bug of 5.23).
SETTINGS: dict[str, dict[str, Any]] = {
    # Mamba heads * head dim must equal expand * hidden; its default has no attention layer (one
    # here, so the KV cache can say its length on the generation path).
    "granitemoehybrid": {"mamba_d_head": 32,
                         "layer_types": ["linear_attention", "attention", "linear_attention", "linear_attention"]},
    # ZAYA routes one expert per token only.
    "zaya": {"num_experts_per_tok": 1},
    # Doge's default config has no MoE layer.
    "doge": {"is_moe": True},
    # Attention at layer 1 and 3, experts at layer 1 and 3 (of 4).
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # The default layer_types is None, which the decoder layers index.
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Its default layer types include QSA-indexed attention, whose indexer sizes it leaves unset
    # (None, which the indexer divides); one key head is required, and a budget of 2 blocks of 4
    # tokens, so the selection is exercised at 16 tokens.
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 4},
}


def _dbrx(c: Any) -> None:
    # DbrxAttentionConfig has no rope_theta, which DbrxAttention reads, and no clip_qkv value,
    # which it clamps with.
    c.attn_config.rope_theta = c.rope_parameters["rope_theta"]
    c.attn_config.clip_qkv = 8.0


def _sliding_window(c: Any) -> None:
    # Its attention reads a sliding window, which the default config leaves unset.
    for sub in (c, getattr(c, "text_config", None)):
        if sub is not None:
            sub.sliding_window = 64


FIXES: dict[str, Callable[[Any], None]] = {"dbrx": _dbrx, "step3p7": _sliding_window}

_MROPE_DEFAULT = re.compile(r"""\.get\(\s*["']mrope_section["']\s*,\s*\[([\d,\s]+)\]""")


def _mrope_sections(model_type: str, c: PretrainedConfig) -> None:
    """Multimodal RoPE splits the rotary half-dim into (t, h, w) sections, which must sum to it:
    a section list the modeling code defaults to (for the full head_dim) is scaled to the
    shrunk one, in proportion (largest remainders), on each config with flat rope_parameters.
    Text positions are the same on the three axes, so the split only has to be valid."""
    family = _family_of(model_type)
    try:
        source = inspect.getsource(importlib.import_module(f"transformers.models.{family}.modeling_{family}"))
    except (ImportError, OSError, TypeError):
        return
    found = _MROPE_DEFAULT.search(source)
    if found is None:
        return
    default = [int(x) for x in found.group(1).split(",") if x.strip()]
    for sub in (c, getattr(c, "text_config", None)):
        rope = getattr(sub, "rope_parameters", None)
        if not isinstance(rope, dict) or "rope_theta" not in rope:
            continue
        head_dim = (getattr(sub, "head_dim", None)
                    or getattr(sub, "hidden_size", 0) // getattr(sub, "num_attention_heads", 1))
        half = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        sections = list(rope.get("mrope_section") or default)
        if sum(sections) != half and half >= len(sections):
            rope["mrope_section"] = apportion(sections, half)


def apportion(weights: Sequence[int], total: int) -> list[int]:
    """Integers >= 1 in proportion to weights, summing to total (largest remainders)."""
    exact = [w * total / sum(weights) for w in weights]
    out = [max(1, int(x)) for x in exact]
    order = sorted(range(len(out)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    i = 0
    while sum(out) < total:
        out[order[i % len(out)]] += 1
        i += 1
    while sum(out) > total:
        j = max(range(len(out)), key=lambda i: (out[i], i))
        out[j] -= 1
    return out


def config(model_type: str) -> PretrainedConfig:
    """The family's default config shrunk to a tiny model."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    before = default.to_dict()
    after = shrink(before)
    changed: dict[str, Any] = {k: v for k, v in after.items() if v != before[k]}
    changed.update(SETTINGS.get(model_type, {}))
    try:
        c = AutoConfig.for_model(model_type, **changed)
    except Exception as e:  # noqa: BLE001 - one retry for families that tie kv heads to heads
        if "key_value_heads" not in str(e):
            raise
        changed["num_key_value_heads"] = changed.get("num_attention_heads", 4)
        c = AutoConfig.for_model(model_type, **changed)
    _mrope_sections(model_type, c)
    fix = FIXES.get(model_type)
    if fix is not None:
        fix(c)
    c.use_cache = True
    return c


def model_class(model_type: str, config: PretrainedConfig) -> type[PreTrainedModel]:
    """The class that builds ``model_type`` from token ids: its causal LM, else its base model,
    else the model class of its modeling module made for this config."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(model_type)
    if name:
        return cast("type[PreTrainedModel]", getattr(transformers, str(name)))
    family = _family_of(model_type)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    made = [c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel) and c.config_class is type(config)
            and not c.__name__.endswith("PreTrainedModel")]
    made.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), not c.__name__.endswith("Model"), c.__name__))
    if not made:
        raise LookupError(f"transformers has no model class for {type(config).__name__}")
    return made[0]


def _hash_tables(model: torch.nn.Module, seed: int) -> None:
    """A hash router's token-id -> experts table is a checkpoint buffer, all zeros at random
    init (every token to expert 0, k times): filled with k distinct seeded experts per id."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        table = getattr(m, "tid2eid", None)
        experts = getattr(m, "num_experts", None)
        if isinstance(table, torch.Tensor) and experts:
            with torch.no_grad():
                table.copy_(torch.rand(table.shape[0], experts, generator=g).argsort(1)[:, :table.shape[1]])


def build(model_type: str, seed: int = 0) -> tuple[PreTrainedModel, PretrainedConfig]:
    """(model, config): the tiny random model of ``model_type`` in eval mode, float32."""
    c = config(model_type)
    torch.manual_seed(seed)
    model = model_class(model_type, c)._from_config(c, torch_dtype=torch.float32)
    _hash_tables(model, seed)
    return model.eval(), c

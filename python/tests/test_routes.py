"""moe_audit.routes.record: Hugging Face models recorded in the generic routing format, read
back by ``moe-audit routes`` (the binary from MOE_AUDIT_BIN or the installed wheel).

Needs torch and transformers; tiny random-init Qwen3-MoE models, seeded.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install moe-audit[hf])")
pytest.importorskip("transformers", reason="transformers is not installed (pip install moe-audit[hf])")

from routes_cli import routes_compare  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import moe_audit.routes as routes  # noqa: E402

LAYERS, EXPERTS, TOP_K, VOCAB = 4, 16, 4, 256


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen3MoeConfig(  # type: ignore[call-arg]  # transformers' types leave out head_dim, which it takes
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=2, mlp_only_layers=[],
    )
    return Qwen3MoeForCausalLM(config)


def ids(batch=2, seq=12, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_a_forward_records_every_moe_layer_with_its_global_number(model, tmp_path):
    rec = routes.record(model, ids(), tmp_path / "f.safetensors", mode="train")
    a, meta = rec["arrays"], rec["metadata"]
    # decoder_sparse_step 2: layers 1 and 3 are MoE.
    assert json.loads(meta["layers"]) == [1, 3]
    assert meta["format"] == "moe-audit-routes/1" and meta["mode"] == "train" and meta["dtype"] == "float32"
    assert a["experts"].shape == (24, 2, TOP_K) and a["experts"].dtype == np.int32
    assert a["logits"].shape == (24, 2, EXPERTS)
    # The recorded ids are the logits' top-k.
    top = np.sort(np.argsort(-a["logits"], axis=-1, kind="stable")[..., :TOP_K], axis=-1)
    assert (np.sort(a["experts"], axis=-1) == top).all()
    assert list(a["cu_seqlens"]) == [0, 12, 24]
    assert model.training


def test_the_binary_reads_a_recording_and_a_repeat_is_a_clean_replay(model, tmp_path):
    x = ids()
    routes.record(model, x, tmp_path / "a.safetensors", mode="eval")
    routes.record(model, x, tmp_path / "b.safetensors", mode="eval")
    code, report = routes_compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--max-disagreement", "0")
    assert code == 0, report["diagnoses"]
    assert report["measures"]["decisions"] == 24 * 2
    assert report["measures"]["decisions_differ"] == 0.0


def test_kv_cache_decoding_covers_the_same_tokens(model, tmp_path):
    x = ids(seq=16)
    routes.record(model, x, tmp_path / "train.safetensors", mode="train")
    rec = routes.record(model, x, tmp_path / "gen.safetensors", mode="eval", generate=True, prefill=5)
    assert rec["metadata"]["source"] == "hf-generate"
    assert rec["arrays"]["experts"].shape == (32, 2, TOP_K)
    code, report = routes_compare(tmp_path / "gen.safetensors", tmp_path / "train.safetensors")
    assert code == 0, report["diagnoses"]
    assert report["alignment"]["tokens"] == 32
    # fp32 decode and fp32 forward of one model route alike but for near-ties.
    assert report["measures"]["decisions_differ"] < 0.1


def test_padding_rows_route_nowhere_and_are_aligned_past(model, tmp_path):
    x = ids(batch=1, seq=10)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, :3] = 0
    rec = routes.record(model, x, tmp_path / "pad.safetensors", mode="eval", attention_mask=mask)
    assert (rec["arrays"]["experts"][:3] == -1).all() and (rec["arrays"]["experts"][3:] >= 0).all()
    routes.record(model, x[:, 3:], tmp_path / "plain.safetensors", mode="eval")
    code, report = routes_compare(tmp_path / "plain.safetensors", tmp_path / "pad.safetensors")
    assert any(d["kind"] == "padding" for d in report["diagnoses"])
    assert report["alignment"]["tokens"] == 7


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="mode must be"):
        routes.record(model, ids(), mode="serve")
    with pytest.raises(ValueError, match="prefill must be"):
        routes.record(model, ids(), generate=True, prefill=0)
    with pytest.raises(TypeError, match="no router in Linear"):
        routes.record(torch.nn.Linear(2, 2), ids())

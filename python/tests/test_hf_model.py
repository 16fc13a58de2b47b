"""Whole transformers models through moe_audit.hf: discovery by structure, decoding, capture,
the moe-audit/3 server, and bad input.

Needs torch and transformers; models are tiny, random and seeded (no download).
"""

import io
import json
import os
import re

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install moe-audit[hf])")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install moe-audit[hf])")

import torch  # noqa: E402

import moe_audit.hf as hf  # noqa: E402
from moe_audit.hf import wire3  # noqa: E402

H, E, K, V = 32, 8, 2, 128


def whole(model) -> hf.WholeModel:
    """hf.wrap of a model taking token ids: a WholeModel (moe-audit/3)."""
    wrapped = hf.wrap(model)
    assert isinstance(wrapped, hf.WholeModel), wrapped
    return wrapped


def causal(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def qwen3(layers=4, **more):
    return causal(transformers.Qwen3MoeConfig(
        hidden_size=H, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K,
        vocab_size=V, **more))


def dbrx():
    config = transformers.DbrxConfig(d_model=H, n_heads=4, n_layers=2, vocab_size=V,
                                     ffn_config={"ffn_hidden_size": 16, "moe_num_experts": E, "moe_top_k": K},
                                     attn_config={"kv_n_heads": 2, "clip_qkv": 8.0})
    config.attn_config.rope_theta = config.rope_parameters["rope_theta"]  # transformers 5.23 forgets it
    return causal(config)


def ids(batch=2, seq=8, seed=0):
    return np.random.default_rng(seed).integers(0, V, (batch, seq))


def test_discover_numbers_every_layer_and_names_dense_layers_and_shared_experts():
    model = qwen3(mlp_only_layers=[0])
    found = hf.discover(model)
    assert found.layers == {0: "dense", 1: "moe", 2: "moe", 3: "moe"}
    assert [s.layer for s in found.sites] == [1, 2, 3]
    assert [s.name for s in found.sites] == [f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)]
    assert {(s.kind, s.experts, s.top_k, s.shared_experts) for s in found.sites} == {("moe", E, K, False)}
    qwen2 = causal(transformers.Qwen2MoeConfig(
        hidden_size=H, intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=E, num_experts_per_tok=K,
        vocab_size=V))
    assert all(s.shared_experts for s in hf.discover(qwen2).sites)


def test_capture_records_every_layer_per_forward_and_ids_are_the_top_k_of_the_logits():
    model = qwen3()
    found = hf.discover(model)
    with hf.capture(found) as rec:
        with torch.no_grad():
            model(input_ids=torch.as_tensor(ids()))
            model(input_ids=torch.as_tensor(ids(1, 5)))
    assert len(rec.calls) == 2 and sorted(rec.calls[0]) == [0, 1, 2, 3]
    d = rec.calls[0][2]
    assert d.logits is not None
    assert d.experts.shape == (16, K) and d.experts.dtype == np.int32 and d.logits.shape == (16, E)
    assert rec.calls[1][0].experts.shape == (5, K)
    top = np.sort(np.argsort(-d.logits, axis=1)[:, :K], axis=1)
    assert np.array_equal(np.sort(d.experts, axis=1), top)
    assert d.kept.all() and d.capacity is None
    # choice order: decreasing weight
    assert (np.diff(d.weights, axis=1) <= 0).all()


def test_dbrx_routes_are_read_where_the_block_hands_them_to_its_experts():
    # DbrxRouter returns its logits only; the block takes the top k.
    model = dbrx()
    found = hf.discover(model)
    assert [type(s.module).__name__ for s in found.sites] == ["DbrxRouter", "DbrxRouter"]
    with hf.capture(found) as rec, torch.no_grad():
        model(input_ids=torch.as_tensor(ids()))
    d = rec.calls[0][0]
    probs = torch.softmax(torch.as_tensor(d.logits), -1)
    expected = torch.topk(probs, K).indices.sort(1).values.numpy()
    assert np.array_equal(np.sort(d.experts, axis=1), expected)


def test_a_model_without_a_router_is_one_clear_error():
    llama = causal(transformers.LlamaConfig(hidden_size=H, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=V))
    with pytest.raises(hf.NotCovered, match=r"^no router in LlamaForCausalLM: searched every submodule"):
        hf.wrap(llama)


class OddRouter(torch.nn.Module):
    """A router no built-in decoder reads: it returns its choices as one packed float tensor."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(E, H) / H ** 0.5)

    def forward(self, x):
        w, i = torch.topk(torch.softmax(x.reshape(-1, H) @ self.weight.T, -1), K)
        return torch.cat([w, i.float()], dim=1)


class OddBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = OddRouter()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(E))

    def forward(self, x):
        packed = self.gate(x)
        w, i = packed[:, :K], packed[:, K:].long()
        flat = x.reshape(-1, H)
        out = torch.stack([sum(w[t, j] * self.experts[int(i[t, j])](flat[t]) for j in range(K))
                           for t in range(len(flat))])
        return out.reshape(x.shape)


def test_a_router_no_decoder_reads_says_how_to_register_one_and_registering_works():
    block = OddBlock()
    found = hf.discover(block)
    x = torch.randn(1, 4, H)
    with pytest.raises(hf.NotCovered) as err, hf.capture(found), torch.no_grad():
        block(x)
    message = str(err.value)
    assert message.startswith("no decoder reads OddRouter (module gate, 8 experts)")
    code = message.split("Register one:\n", 1)[1]
    assert len(code.splitlines()) <= 10 and "register_decoder(OddRouter, decode)" in code

    def decode(router, inputs, output):
        return hf.Decoded.of(output[:, K:].long(), output[:, :K])

    hf.register_decoder(OddRouter, decode)
    try:
        found = hf.discover(block)
        with hf.capture(found) as rec, torch.no_grad():
            block(x)
        d = rec.calls[0][0]
        logits = x.reshape(-1, H) @ block.gate.weight.T
        assert np.array_equal(np.sort(d.experts, 1), torch.topk(logits, K).indices.sort(1).values.numpy())
    finally:
        hf.unregister_decoder(OddRouter)


def serve(wrapped, *requests):
    """Responses of a moe-audit/3 conversation with wrapped, as the binary reads them."""
    inp = io.BytesIO(b"".join(h + p for h, p in requests))
    out = io.BytesIO()
    wrapped.serve(inp, out)
    out.seek(0)
    hs = json.loads(out.readline())
    return hs, [wire3.read_response(out, hs) for _ in requests]


def test_the_server_answers_forward_and_generate_requests_with_every_layer():
    model = qwen3(mlp_only_layers=[0])
    wrapped = whole(model)
    x = ids(2, 8)
    padding = np.zeros((2, 8), dtype=bool)
    padding[1, 6:] = True
    hs, (fwd, gen) = serve(wrapped, wire3.request(1, x), wire3.request(2, x, padding=padding, path="generate",
                                                                       prefill=3))
    assert hs["protocol"] == "moe-audit/3" and hs["vocab"] == V and hs["outputs"] == H and hs["logits"]
    assert hs["layers"][0] == {"layer": 0, "kind": "dense"}
    assert hs["layers"][1] == {"layer": 1, "kind": "moe", "experts": E, "top_k": K}
    assert [lay["layer"] for lay in fwd["layers"]] == [1, 2, 3]
    direct, rows = wrapped.forward(x, "train", 0)
    for lay in fwd["layers"]:
        d = direct[lay["layer"]]
        assert lay["count"].tolist() == [K] * 16 and lay["capacity"] is None
        assert np.array_equal(lay["expert"], d.experts.reshape(-1))
        assert d.logits is not None and np.array_equal(lay["logits"], d.logits)
    assert rows is not None and np.array_equal(fwd["outputs"], rows)
    # The generation path (KV cache, one token at a time) routes the real tokens of a
    # dropless model as one forward does (fp32; a near-tie could differ, none does here).
    real = ~padding.reshape(-1)
    for f, g in zip(fwd["layers"], gen["layers"]):
        same = np.sort(f["expert"].reshape(16, K), 1) == np.sort(g["expert"].reshape(16, K), 1)
        assert same[real[:16]].all() if f["layer"] == 1 else same[:8].all()
    assert np.allclose(gen["outputs"][:8], fwd["outputs"][:8], atol=1e-4)


def test_bad_input_is_one_clear_error():
    wrapped = whole(qwen3(layers=2))
    with pytest.raises(ValueError, match=r"request 7: token id 128 at sequence 1, position 2 is not below the "
                                         r"vocabulary size 128"):
        x = ids(2, 4)
        x[1, 2] = V
        serve(wrapped, wire3.request(7, x))
    with pytest.raises(TypeError, match="token ids must be integers, got <U5 \\(a model without a tokenizer takes ids"):
        wrapped.forward(np.array([["hello"]]))
    with pytest.raises(ValueError, match="says 12 bytes, expected 32"):
        h, p = wire3.request(3, ids(2, 4))
        serve(wrapped, (h.replace(b'"bytes": 32', b'"bytes": 12'), p[:12]))


def test_the_readmes_whole_model_audit_is_at_most_five_lines_and_wraps_every_layer(monkeypatch):
    readme = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
    with open(readme) as f:
        found = re.search(r"```python\n(import moe_audit, moe_audit.hf, transformers\n.*?)```", f.read(), re.S)
    assert found, "the README's whole-model audit"
    block = found.group(1)
    assert len([line for line in block.splitlines() if line.strip()]) <= 5, block
    import moe_audit

    class Printed(moe_audit.Report):
        stdout = ""  # what the README printed while check returned the finished process

    audited = []

    def check(wrapped):
        audited.append(wrapped)
        return Printed({"findings": []}, 0)

    monkeypatch.setattr(moe_audit, "check", check)
    exec(block, {})
    hs = audited[0].handshake()
    assert [(x["kind"], x["experts"], x["top_k"]) for x in hs["layers"]] == [("moe", 64, 8)] * 4
    assert hs["vocab"] == 1000 and hs["outputs"] == 128 and hs["generate"]


# Whole-model audits by the binary (moe-audit/3), at coverage.audit_model's small sizes.
def audit(model, **options):
    from moe_audit.hf import coverage

    verdicts, first, error = coverage.audit_model(hf.wrap(model, **options))
    assert error is None, error
    return verdicts, first


def test_a_dropless_model_passes_every_probe_at_every_layer():
    verdicts, _ = audit(qwen3(mlp_only_layers=[0]))
    assert verdicts == dict.fromkeys("PFNRDSMG", "pass")


def nllb(capacity):
    config = transformers.NllbMoeConfig(
        d_model=H, encoder_layers=2, decoder_layers=4, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_experts=E, expert_capacity=capacity, encoder_sparse_step=2,
        decoder_sparse_step=2, vocab_size=V, dropout=0.0)
    torch.manual_seed(0)
    return transformers.NllbMoeModel(config).eval()


def test_nllb_moe_capacity_leaks_first_at_its_moe_layer():
    # Sparse decoder layers 1 and 3 (every second); capacity 4 per expert for the whole call.
    model = nllb(capacity=4)
    assert hf.discover(model.get_decoder()).layers == {0: "dense", 1: "moe", 2: "dense", 3: "moe"}
    verdicts, first = audit(model)
    leaking = {p for p, v in verdicts.items() if v == "leak"}
    assert {"P", "F", "N", "R"} <= leaking, verdicts
    assert all(first[p] == 1 for p in leaking), first


def test_switch_with_binding_per_sequence_capacity_is_causal():
    config = transformers.SwitchTransformersConfig(
        d_model=H, d_ff=32, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2, num_sparse_encoder_layers=1,
        num_sparse_decoder_layers=2, num_experts=E, expert_capacity=2, router_jitter_noise=0.0, vocab_size=V,
        dropout_rate=0.0)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersModel(config).eval()
    wrapped = whole(model)
    x = ids(2, 16)
    layers, _ = wrapped.forward(x, "train", 0)
    assert any(not d.kept.all() for d in layers.values()), "the capacity must bind in this test"
    assert all(d.capacity == {"scope": "sequence", "slots": [2, 2]} for d in layers.values())
    verdicts, _ = audit(model)
    # First come first served within each sequence: causal (P F), batch-invariant (N),
    # deterministic (D S), the same rule in both modes (M); P may see near-ties (drift).
    assert all(verdicts[p] in ("pass", "drift") for p in "PFNDSM"), verdicts
    # Measured, and real: left padding takes capacity slots from the real tokens after it (the
    # router gets no padding mask), and generating one token at a time never fills the capacity
    # the full forward fills.
    assert verdicts["R"] == "leak" and verdicts["G"] == "leak", verdicts


# Issue 37: a whole model audits, or fails with one line naming its family and the config field,
# never a raw exception. Both at the sizes (batch 2 x seq 16).
MLA = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, n_routed_experts=8,
           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16,
           q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)


def mla(family, **change):
    return causal(transformers.AutoConfig.for_model(family, **dict(MLA, **change)))


def one_line_refusal(model):
    with pytest.raises(hf.NotCovered) as err:
        hf.wrap(model)
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_glm4_moe_lite_with_mla_and_grouped_kv_heads_fails_in_one_line_naming_the_field():
    # MLA expands the latent keys and values to every head, and the attention then repeats them
    # num_attention_heads / num_key_value_heads times: 8 key heads for 4 query heads. The model's
    # own forward fails on it (transformers 5.23.0); the wrapper says which field, in one line.
    model = mla("glm4_moe_lite")
    with pytest.raises(RuntimeError, match="must match the size of tensor b"):
        model(torch.tensor([[1, 2, 3]]))
    message = one_line_refusal(model)
    assert message.startswith("glm4_moe_lite: the model's own forward fails with this config"), message
    assert "config.num_key_value_heads is 2" in message and "set num_key_value_heads to 4" in message, message
    # With the field set as it says, the model audits, and its routing is dropless: every probe passes.
    verdicts, _ = audit(mla("glm4_moe_lite", num_key_value_heads=4))
    assert verdicts == dict.fromkeys("PFNRDSMG", "pass")


def test_deepseek_v4_hash_layers_that_pick_one_expert_twice_are_refused_saying_why():
    # Its hash layers route by tid2eid[input_ids], a buffer a checkpoint fills; built from a
    # config it is all zeros, so every token goes to expert 0 k times. The model routes that way;
    # a routing record holds an expert once per token: refused in one line naming the field.
    message = one_line_refusal(mla("deepseek_v4"))
    expected = "deepseek_v4: layer 0 sends token 0 to expert 0 twice through its hash table tid2eid"
    assert message.startswith(expected), message
    assert "config.mlp_layer_types" in message and "the model routes that way" in message, message
    # Its top-k layers pick distinct experts: audited, dropless, every probe passes.
    verdicts, _ = audit(mla("deepseek_v4", mlp_layer_types=["moe", "moe"]))
    assert verdicts == dict.fromkeys("PFNRDSMG", "pass")


def test_run_leaves_the_scripts_own_arguments_alone(monkeypatch):
    wrapped = whole(qwen3(layers=2))
    served = []
    monkeypatch.setattr(wrapped, "serve", lambda: served.append(True))
    monkeypatch.setattr("sys.argv", ["my_server.py", "--checkpoint", "x"])
    wrapped.run()
    assert served == [True]
    with pytest.raises(SystemExit, match="serves moe-audit/3 on stdin/stdout"):
        wrapped.run(["--checkpoint", "x"])

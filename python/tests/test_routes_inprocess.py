"""moe_audit.routes.compare: the rollout-against-trainer check in this process (the native
extension), against ``moe-audit routes compare --format json`` on the same inputs."""

import base64
import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from routes_cli import routes_compare as command_compare

import moe_audit
import moe_audit.routes as routes
from moe_audit import binary

TOKENS, LAYERS, TOP_K, EXPERTS = 48, 4, 2, 8


def ids(seed, tokens=TOKENS, dtype=np.int32):
    """Distinct top-k expert ids per (token, layer), seeded."""
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, LAYERS, EXPERTS)), axis=2)[:, :, :TOP_K].astype(dtype)


def flipped(a, share=0.25, seed=7):
    """``a`` with the second choice of some (token, layer) pairs replaced by an unused expert."""
    b = a.copy()
    rng = np.random.default_rng(seed)
    for t, layer in zip(*np.nonzero(rng.random(a.shape[:2]) < share)):
        b[t, layer, 1] = next(e for e in range(EXPERTS) if e not in a[t, layer])
    return b


CONFIG = {
    "model_type": "qwen3_moe", "num_hidden_layers": LAYERS, "num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def routes_compare(*args):
    """`moe-audit routes compare` and its JSON as Python is told it: the report names a setting
    as `compare`'s keyword (`config`), the command as its flag (`--config`)."""
    code, doc = command_compare(*args)
    text = json.dumps(doc)
    for flag in ("--config", "--max-disagreement", "--max-memory"):
        text = text.replace(flag, flag[2:].replace("-", "_"))
    return code, json.loads(text)


def without_paths(doc):
    doc = json.loads(json.dumps(doc))
    for side in ("rollout", "trainer"):
        doc[side].pop("path")
    return doc


@pytest.fixture
def files(tmp_path):
    a, b = ids(1), flipped(ids(1))
    np.save(tmp_path / "engine.npy", a)
    np.save(tmp_path / "trainer.npy", b)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path, a, b


@pytest.mark.parametrize("extra", [{}, {"max_disagreement": 0.0}, {"max_disagreement": 0.5}, {"config": True}])
def test_to_dict_is_the_commands_json_on_the_same_files(files, extra):
    d, _, _ = files
    flags = []
    kwargs = dict(extra)
    if "max_disagreement" in extra:
        flags += ["--max-disagreement", str(extra["max_disagreement"])]
    if extra.get("config"):
        kwargs["config"] = d / "config.json"
        flags += ["--config", str(d / "config.json")]
    code, doc = routes_compare(d / "engine.npy", d / "trainer.npy", *flags)
    c = routes.compare(d / "engine.npy", str(d / "trainer.npy"), **kwargs)
    assert c.to_dict() == doc
    assert c.exit_code == code and c.failed == doc["failed"]
    assert c.diagnoses == doc["diagnoses"] and c.measures == doc["measures"]


def test_arrays_give_what_the_command_gives_on_their_npy_files(files):
    d, a, b = files
    a = a.copy()
    a[5] = -1  # a padding row: no route in any layer
    np.save(d / "engine.npy", a)
    cases: list[tuple[dict[str, Any], list[str]]] = [({}, []), ({"max_disagreement": 0.0}, ["--max-disagreement", "0"])]
    for extra, flags in cases:
        code, doc = routes_compare(d / "engine.npy", d / "trainer.npy", *flags)
        c = routes.compare(a, b, **extra)
        assert without_paths(c.to_dict()) == without_paths(doc)
        assert c.failed == bool(code)
    assert c.to_dict()["rollout"]["path"] == f"rollout (int32 {TOKENS}x{LAYERS}x{TOP_K})"


def test_an_sglang_json_rollout_reads_as_the_command_reads_it(files):
    # The extension's own branch: a `.json` rollout is read after the trainer, whose top-k shapes
    # it with the response's own row count. As SGLang writes it (sgl-project/sglang@v0.5.10):
    # `meta_info.routed_experts`, base64 of the int32 bytes of [seqlen - 1, num_hidden_layers,
    # top_k] (tokenizer_manager.py:1593-1598, routed_experts_capturer.py:211-220), with
    # prompt_tokens + completion_tokens = seqlen (scheduler_output_processor_mixin.py:1044-1046).
    d, a, _ = files
    payload = base64.b64encode(a[:-1].astype(np.int32).tobytes()).decode()
    meta = {"prompt_tokens": TOKENS - 6, "completion_tokens": 6, "routed_experts": payload}
    (d / "engine.json").write_text(json.dumps({"text": "..", "meta_info": meta}))
    config = d / "config.json"
    for kwargs, flags in (({}, []), ({"config": config}, ["--config", str(config)])):
        code, doc = routes_compare(d / "engine.json", d / "trainer.npy", *flags)
        c = routes.compare(d / "engine.json", d / "trainer.npy", **kwargs)
        assert c.to_dict() == doc
        assert c.exit_code == code
        assert doc["rollout"]["format"] == "sglang" and doc["rollout"]["layers"] == list(range(LAYERS))
        assert doc["measures"]["decisions"] == (TOKENS - 1) * LAYERS


def test_a_torch_tensor_and_a_numpy_array_give_the_same_result(files):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    _, a, b = files
    for dtype, tdtype in ((np.uint8, torch.uint8), (np.int16, torch.int16), (np.int64, torch.int64)):
        from_numpy = routes.compare(a.astype(dtype), b.astype(dtype), max_disagreement=0.0)
        from_torch = routes.compare(torch.tensor(a, dtype=tdtype), torch.tensor(b, dtype=tdtype), max_disagreement=0.0)
        assert from_numpy.to_dict() == from_torch.to_dict()
        assert from_numpy.failed and from_numpy.measures["decisions_differ"] > 0
    # Every integer dtype reads the same ids.
    base = without_paths(routes.compare(a, b).to_dict())
    for dtype in (np.uint8, np.int8, np.uint16, np.int64, np.uint32):
        doc = without_paths(routes.compare(a.astype(dtype), b.astype(dtype)).to_dict())
        for side in ("rollout", "trainer"):
            assert doc[side]["found"].pop("dtype") == np.dtype(dtype).name
            base[side]["found"].pop("dtype", None)
        assert doc == base


def test_per_sequence_lists_are_sequences(files):
    _, a, b = files
    c = routes.compare([a[:20], a[20:]], [b[:20], b[20:]])
    whole = routes.compare(a, b)
    assert c.measures["decisions_differ"] == whole.measures["decisions_differ"]
    assert [s["len"] for s in c.to_dict()["alignment"]["segments"]] == [20, TOKENS - 20]


def test_identical_records_pass_a_replay_check_and_metrics_are_flat_floats(files):
    _, a, _ = files
    c = routes.compare(a, a.copy(), config=CONFIG, max_disagreement=0.0)
    assert not c.failed and c.defects == []
    m = c.metrics()
    assert m["r3/decisions_differ"] == 0.0 and m["r3/failed"] == 0.0 and m["r3/defects"] == 0.0
    assert all(isinstance(v, float) for v in m.values())
    assert {f"r3/layer/{g}/decisions_differ" for g in range(LAYERS)} <= set(m)
    bad = routes.compare(a, flipped(a), config=CONFIG, max_disagreement=0.0).metrics(prefix="replay/")
    assert bad["replay/failed"] == 1.0 and bad["replay/decisions_differ"] > 0
    assert any(k.startswith("replay/layer/") and v > 0 for k, v in bad.items())


def test_bad_input_raises_the_packages_error_with_the_commands_line(files, tmp_path):
    d, a, b = files
    (tmp_path / "bad.json").write_text("{not json")
    # The same line, a setting named as the caller gave it: a keyword in Python, a flag on the
    # command line.
    for args, kwargs, flags in (
        ((d / "engine.npy", tmp_path / "absent.npy"), {}, []),
        ((d / "engine.npy", tmp_path / "bad.json"), {}, []),
        ((d / "engine.npy", d / "trainer.npy"), {"max_disagreement": 2.0}, ["--max-disagreement", "2"]),
        ((d / "engine.npy", d / "trainer.npy"), {"config": tmp_path / "bad.json"},
         ["--config", str(tmp_path / "bad.json")]),
    ):
        with pytest.raises(moe_audit.RoutesError) as e:
            routes.compare(*args, **kwargs)
        out = subprocess.run([binary(), "routes", "compare", *map(str, args), *flags], capture_output=True, text=True)
        assert out.returncode == 2
        said = str(e.value)
        for keyword in kwargs:
            if keyword != "config":  # `config` is a file: its errors name the file, as the command's do
                assert keyword in said and f"--{keyword.replace('_', '-')}" not in said, said
                said = said.replace(keyword, f"--{keyword.replace('_', '-')}")
        assert out.stderr == f"error: {said}\n"
        assert "\n" not in str(e.value)
    assert issubclass(moe_audit.RoutesError, ValueError)
    for side, message in (
        (a.astype(np.float32), "dtype float32: expert ids must be integers"),
        (a[:, 0], "shape [48, 2]: expert ids are [tokens, layers, top_k]"),
        ([a[:, :2], a], "every sequence has the same layers"),
        ({"logits": a}, "holds `experts`"),
    ):
        with pytest.raises(moe_audit.RoutesError, match=message.replace("[", r"\[").replace("]", r"\]")):
            routes.compare(side, b)
    with pytest.raises(moe_audit.RoutesError, match="the config contradicts the record: top-k"):
        routes.compare(a, b, config=dict(CONFIG, num_experts_per_tok=4))


def peak_rss_growth(code):
    """Peak RSS growth (bytes) of a fresh interpreter while it runs ``code`` (after its setup
    in ``code``'s first part, split at ``# measure``). VmHWM, not ru_maxrss: Linux carries
    ru_maxrss across exec, so a child of a large pytest would start at its parent's peak."""
    setup, run = code.split("# measure")
    script = textwrap.dedent(setup) + textwrap.dedent("""
        def peak():
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        before = peak()
    """) + textwrap.dedent(run) + textwrap.dedent("""
        print(peak() - before)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="peak RSS read from /proc (Linux)")
def test_a_memory_mapped_record_is_read_in_place(tmp_path):
    # 8 MiB files of uint8 ids (int32 in the record: 32 MiB a side). The pages of the mapping count
    # in RSS once touched, so "in place" is: no copy on top of what a copying reader would hold.
    tokens = (8 << 20) // (LAYERS * TOP_K)
    a = np.lib.format.open_memmap(tmp_path / "a.npy", mode="w+", dtype=np.uint8, shape=(tokens, LAYERS, TOP_K))
    a[:] = ids(3, tokens=4096, dtype=np.uint8)[np.arange(tokens) % 4096]
    a.flush()
    del a
    setup = f"""
        import numpy as np, moe_audit.routes as routes
        a = np.load({str(tmp_path / 'a.npy')!r}, mmap_mode="r")
        small = np.zeros((64, {LAYERS}, {TOP_K}), np.uint8) + np.arange({TOP_K}, dtype=np.uint8)
        routes.compare(small, small)  # the extension loaded and warm
    """
    in_place = peak_rss_growth(setup + "# measure\nc = routes.compare(a, a)\n")
    copied = peak_rss_growth(setup + "# measure\nc = routes.compare(a.astype(np.int32), a.astype(np.int32))\n")
    size = os.path.getsize(tmp_path / "a.npy")
    # Two int32 copies (what a reader converting before the extension would hold) are 8x the
    # file. In place, the mapping's pages are given back as they are read (it is read-only and
    # shared: the file holds them): what stays is the comparison's own state (at this size the
    # alignment hashes almost every row: 8 MiB). Measured 2026-11-26: 9 MiB in place, 78 MiB
    # copied (8 MiB file); before pages were given back, 101 MiB in place.
    assert copied - in_place > 6 * size, (in_place, copied, size)
    assert in_place < 2 * size, (in_place, size)


def test_a_hugging_face_models_routes_compare_without_a_file(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=4, decoder_sparse_step=2, mlp_only_layers=[],
    )
    model = transformers.Qwen3MoeForCausalLM(config)
    tokens = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    trainer = routes.record(model, tokens, mode="eval")
    engine = routes.record(model, tokens, tmp_path / "engine.safetensors", mode="eval", generate=True, prefill=4)
    c = routes.compare(tmp_path / "engine.safetensors", trainer, config=config.to_dict(), max_disagreement=0.5)
    # decoder_sparse_step 2: layers 1 and 3 are MoE, numbered by the record's own layers.
    assert [layer["trainer"] for layer in c.measures["layers"]] == [1, 3]
    assert c.to_dict()["trainer"]["found"]["numbering"] == "declared by the caller"
    assert c.measures["tokens"] == 20 and not c.defects
    # Its sequences (cu_seqlens) kept: the two batch rows pair as in the file.
    assert [s["len"] for s in c.to_dict()["alignment"]["segments"]] == [10, 10]
    same = routes.compare(engine, engine, config=config.to_dict(), max_disagreement=0.0)
    assert not same.failed and same.measures["decisions_differ"] == 0.0


def test_megatron_router_replay_instances_compare_directly(files):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    replay = pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="megatron-core is not installed")
    _, a, b = files
    replay.RouterReplay.clear_global_router_replay_instances()
    try:
        instances = [replay.RouterReplay() for _ in range(LAYERS)]
        for i, r in enumerate(instances):
            r.record_indices(torch.tensor(b[:, i], dtype=torch.int64))  # torch.topk's indices
        trainer = routes.router_replay()
        assert trainer["experts"].shape == (TOKENS, LAYERS, TOP_K) and trainer["layers"] is None
        c = routes.compare(b, trainer, max_disagreement=0.0)
        assert not c.failed
        replayed = routes.router_replay(instances, layers=[0, 1, 2, 3])
        assert routes.compare(a, replayed).to_dict()["measures"] == routes.compare(a, b).measures
        instances[2].clear_indices()
        with pytest.raises(moe_audit.RoutesError, match="RouterReplay instance 2 recorded nothing"):
            routes.router_replay()
    finally:
        replay.RouterReplay.clear_global_router_replay_instances()

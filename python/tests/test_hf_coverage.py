"""docs/hf-coverage.md stays true: every MoE family it lists as covered is still covered.

The full table (every family audited by the binary) is `python3 -m moe_audit.hf.coverage --write
docs/hf-coverage.md`, a separate run; here every covered family is built, discovered, decoded
(checked against the top k of its logits) and run on the generation path, and a fixed sample is
audited by the binary and must keep its verdicts.
"""

import os
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install moe-audit[hf])")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install moe-audit[hf])")

from moe_audit.hf import coverage, families  # noqa: E402

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "hf-coverage.md")
#: Audited here too (the rest only in the full run): a dropless family with a dense first layer,
#: one whose router leaves the top k to its block, a hybrid (Mamba) one, a capacity one.
AUDITED = ("deepseek_v3", "dbrx", "jamba", "nllb_moe")


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the coverage run uses: tiny models gain nothing from more, and on a
    loaded machine their threads wait on each other (twice as slow on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _table():
    with open(TABLE) as f:
        text = f.read()
    found = re.search(r"MoE families of transformers (\S+) covered", text)
    assert found, TABLE
    version = found.group(1)
    if version != transformers.__version__:
        pytest.skip(f"docs/hf-coverage.md is for transformers {version}, {transformers.__version__} is installed")
    return coverage.read_table(TABLE), coverage.read_rows(TABLE)


def test_the_table_lists_every_moe_family_of_the_installed_transformers():
    listed, _ = _table()
    assert sorted(listed) == sorted(families.families())


def _covered():
    try:
        listed = coverage.read_table(TABLE)
    except OSError:
        return []
    return sorted(f for f, ok in listed.items() if ok)


@pytest.mark.parametrize("family", _covered())
def test_a_covered_family_stays_covered(family):
    _, rows = _table()
    row = coverage.cover(family, families.families()[family], audit=family in AUDITED)
    assert row["reason"] == "", row
    assert row["decode"] == rows[family]["decode"]
    if family in AUDITED:
        assert row["verdicts"] == rows[family]["verdicts"]


def test_shrinking_keeps_the_sizes_a_config_derives_from_others():
    # MLA: head_dim = qk_nope + qk_rope, in the config and in a layer's overrides over it
    d: dict[str, Any] = {"hidden_size": 4096, "num_attention_heads": 32, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
         "head_dim": 128, "num_hidden_layers": 8, "per_layer_config": {"3": {"qk_nope_head_dim": 192}}}
    out = families.shrink(d)
    assert out["head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"] == 32
    assert out["per_layer_config"] == {"3": {"qk_nope_head_dim": 16}}  # 192 + 64 is not head_dim 128: not tied
    d["per_layer_config"]["3"]["head_dim"] = 256
    assert families.shrink(d)["per_layer_config"]["3"]["head_dim"] == 32
    # a sub-config's <part>_hidden_size follows the sibling <part>_config's hidden size
    d = {"audio_config": {"hidden_size": 512}, "head_config": {"hidden_size": 192, "audio_hidden_size": 512}}
    assert families.shrink(d)["head_config"]["audio_hidden_size"] == families.HIDDEN
    # layers counted by their per-layer types, one attention layer kept
    d = {"hidden_size": 2688, "layers_block_type": ["mamba", "moe"] * 5 + ["attention", "moe"]}
    assert families.shrink(d)["layers_block_type"] == ["mamba", "moe", "mamba", "attention"]


def test_multimodal_rope_sections_are_apportioned_to_the_rotary_half_dim():
    assert families.apportion([8, 12, 12], 4) == [1, 2, 1]
    assert families.apportion([22, 22, 20], 8) == [3, 3, 2]  # Ernie 4.5 VL: h and w stay equal
    assert families.apportion([24, 20, 20], 64) == [24, 20, 20]

"""docs/hf-coverage.md stays true: every MoE family it lists as covered is still covered.

The full table (every family audited by the binary) is `python3 -m moe_audit.hf.coverage --write
docs/hf-coverage.md`, a separate run; here every covered family is built, discovered, decoded
(checked against the top k of its logits) and run on the generation path, and a fixed sample is
audited by the binary and must keep its verdicts.
"""

import os
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install moe-audit[hf])")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install moe-audit[hf])")

from moe_audit.hf import coverage, families  # noqa: E402

TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "hf-coverage.md")
#: Audited here too (the rest only in the full run): a dropless family with a dense first layer,
#: one whose router leaves the top k to its block, a hybrid (Mamba) one, a capacity one.
AUDITED = ("deepseek_v3", "dbrx", "jamba", "nllb_moe")


def _table():
    with open(TABLE) as f:
        text = f.read()
    version = re.search(r"MoE families of transformers (\S+) covered", text).group(1)
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

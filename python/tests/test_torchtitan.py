"""TorchTitan's MoE layer (torchtitan 0.3.0, torchtitan/models/common/moe.py) through
moe_audit.torchtitan's driver: in this process against plain-torch references, and expert-parallel
at EP 2 (one `torch.distributed.run` launch of torchtitan_ep.py) against the same layer at EP 1.

Needs torch and torchtitan (`pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3` and
`pip install tyro`); without them the module is skipped with the reason (under CI it fails:
conftest.py). File:line references are torchtitan 0.3.0's, under torchtitan/.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("torchtitan.models.common.moe",
                    reason="torchtitan is not installed or does not import (pip install --no-deps torchtitan==0.3.0 "
                           "spmd_types==0.2.3; pip install tyro)")

import torch.nn.functional as F  # noqa: E402
from torchtitan_ep import BATCH, EXPERTS, HIDDEN, SEQ, TOP_K, build  # noqa: E402

import moe_audit  # noqa: E402
import moe_audit.torchtitan as mtt  # noqa: E402

HERE = Path(__file__).resolve().parent


def hidden(seed=3, batch=BATCH, seq=SEQ):
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))


def reference_routes(moe, x, bias=None):
    """The token-choice top-k TorchTitan documents, in plain torch: scores from the gate (softmax or
    sigmoid), the k best of scores + bias in descending order, gates from the scores without the
    bias, normalised over the k when route_norm, times route_scale (moe.py:297-336)."""
    r = moe.router
    logits = x.reshape(-1, HIDDEN) @ r.gate.weight.detach().T
    scores = logits.softmax(-1) if r.score_func == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    experts = choice.topk(r.top_k, dim=-1, sorted=True).indices
    gates = scores.gather(-1, experts)
    if r.route_norm:
        gates = gates / gates.sum(-1, keepdim=True)
    return experts.numpy(), (gates * r.route_scale).double().numpy()


def reference_output(moe, x, dtype):
    """The layer's output from its routes, each expert a SwiGLU (silu(x w1^T) * (x w3^T)) w2^T computed
    in dtype, its rows scaled by their gate in float32 and summed (moe.py:94-108,
    token_dispatcher.py:156-168)."""
    experts, gates = reference_routes(moe, x)
    inner = moe.routed_experts.inner_experts
    w1, w2, w3 = (getattr(inner, n).detach().to(dtype) for n in ("w1_EFD", "w2_EDF", "w3_EFD"))
    rows = x.reshape(-1, HIDDEN)
    out = torch.zeros_like(rows)
    for t in range(rows.shape[0]):
        for e, g in zip(experts[t], gates[t]):
            h = rows[t].to(dtype)
            y = (F.silu(h @ w1[e].T) * (h @ w3[e].T)) @ w2[e].T
            out[t] += y.float() * float(g)
    return out


@pytest.mark.parametrize("score_func,route_norm,route_scale", [
    ("softmax", True, 1.0), ("softmax", False, 2.5), ("sigmoid", True, 1.0), ("sigmoid", False, 1.0)])
def test_routes_are_the_routers_top_k_and_gates(score_func, route_norm, route_scale):
    moe = build(score_func=score_func, route_norm=route_norm, route_scale=route_scale)
    driver = mtt.wrap(moe)
    assert (driver.experts, driver.top_k, driver.hidden_size) == (EXPERTS, TOP_K, HIDDEN)
    assert driver.name == f"torchtitan-{score_func}-top{TOP_K}-ep1"
    x = hidden()
    local = driver.forward(x, "inference", None)
    experts, gates = reference_routes(moe, x)
    assert local.experts.dtype == np.int64 and local.experts.shape == (BATCH * SEQ, TOP_K)
    assert np.array_equal(local.experts, experts)  # the order too: descending on the CPU
    np.testing.assert_allclose(local.weights, gates, rtol=1e-6, atol=1e-7)
    assert local.kept.all() and local.kept.shape == experts.shape and local.capacity is None


def test_the_expert_bias_moves_the_choice_and_not_the_gates():
    moe = build()
    x = hidden()
    unbiased = mtt.wrap(moe).forward(x, "inference", None)
    bias = torch.zeros(EXPERTS)
    bias[3] = 10.0  # larger than any score difference: expert 3 is in every token's top-k
    moe.expert_bias_E.copy_(bias)
    local = mtt.wrap(moe).forward(x, "inference", None)
    assert (local.experts == 3).any(axis=1).all() and not (unbiased.experts == 3).all()
    experts, gates = reference_routes(moe, x, bias)
    assert np.array_equal(local.experts, experts)
    np.testing.assert_allclose(local.weights, gates, rtol=1e-6, atol=1e-7)
    # A gate is the expert's score without the bias: expert 3's gate is what it was where it was chosen.
    chosen = (unbiased.experts == 3) & (local.experts == unbiased.experts)
    np.testing.assert_allclose(local.weights[chosen], unbiased.weights[chosen], rtol=1e-6)


def test_output_is_the_layers_own_and_its_experts_compute_in_bfloat16():
    moe = build()
    driver = mtt.wrap(moe)
    x = hidden()
    local = driver.forward(x, "train", None)
    assert local.output is not None
    with torch.no_grad():
        own = moe(x).reshape(-1, HIDDEN).numpy()
    assert local.output.dtype == np.float32 and np.array_equal(local.output, own)
    assert driver.output_dtype == "bfloat16"
    bf16 = reference_output(moe, x, torch.bfloat16).numpy()
    f32 = reference_output(moe, x, torch.float32).numpy()
    scale = np.abs(f32).max()
    # Equal to the bfloat16 computation up to float32 summation order; off the float32 one by more
    # than float32's tolerance (2^-13) and within bfloat16's (2^-5).
    assert np.abs(local.output - bf16).max() <= 1e-6 * scale
    assert 2**-13 * scale < np.abs(local.output - f32).max() <= 2**-5 * scale


def test_modes_route_alike_and_training_counts_tokens_per_expert():
    moe = build()
    driver = mtt.wrap(moe)
    x = hidden()
    inference = driver.forward(x, "inference", None)
    assert not moe.training and moe.tokens_per_expert_E.sum() == 0
    train = driver.forward(x, "train", 5)
    assert train.output is not None and inference.output is not None
    assert moe.training
    assert np.array_equal(train.experts, inference.experts) and np.array_equal(train.output, inference.output)
    counts = np.bincount(train.experts.ravel(), minlength=EXPERTS)
    assert np.array_equal(moe.tokens_per_expert_E.numpy(), counts)  # moe.py:444-446


def test_fingerprint_covers_the_router_the_bias_and_every_expert():
    moe = build(seed=4)
    digest = mtt.wrap(moe).fingerprint()
    assert len(digest) == 32 and digest == mtt.wrap(build(seed=4)).fingerprint()
    assert digest != mtt.wrap(build(seed=5)).fingerprint()
    for change in (lambda m: m.router.gate.weight, lambda m: m.expert_bias_E,
                   lambda m: m.routed_experts.inner_experts.w2_EDF[-1]):
        other = build(seed=4)
        with torch.no_grad():
            change(other).view(-1)[0] += 1e-3
        assert mtt.wrap(other).fingerprint() != digest


def test_seed_weights_draws_every_weight_at_its_fan_in():
    moe = build(seed=9)
    again = build(seed=9)
    for (name, p), (_, q) in zip(moe.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), name
        assert abs(float(p.detach().std()) * p.shape[-1] ** 0.5 - 1) < 0.1, name
    assert {n for n, _ in moe.named_parameters()} == {
        "router.gate.weight", "routed_experts.inner_experts.w1_EFD", "routed_experts.inner_experts.w2_EDF",
        "routed_experts.inner_experts.w3_EFD"}


def test_bad_layers_are_named():
    with pytest.raises(TypeError, match="expected a torchtitan MoE.*got Linear"):
        mtt.wrap(torch.nn.Linear(2, 2))
    moe = build()
    inner = moe.routed_experts.inner_experts
    inner.w1_EFD = torch.nn.Parameter(inner.w1_EFD.detach()[:4].clone())
    with pytest.raises(ValueError, match=r"w1_EFD holds 4 experts on each of 1 expert-parallel rank\(s\), the router "
                                         "chooses among 8"):
        mtt.wrap(moe)
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    moe = build()
    moe.routed_experts.token_dispatcher = LocalTokenDispatcher(LocalTokenDispatcher.Config(num_experts=8, top_k=2))
    with pytest.raises(TypeError, match="LocalTokenDispatcher does not run expert-parallel"):
        mtt.expert_parallel(moe, None)  # type: ignore[arg-type]  # refused before the mesh is read


def test_expert_parallel_at_ep_2_routes_and_outputs_as_at_ep_1(tmp_path):
    # One launch (~15 s, ~0.9 GB a rank on 2 cores): rank 0 compares EP 2, wired by expert_parallel and
    # by TorchTitan's parallelize, with EP 1 (torchtitan_ep.py).
    package = os.path.dirname(os.path.dirname(moe_audit.__file__))  # the moe_audit this test imports
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([package, str(HERE)]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(HERE / "torchtitan_ep.py"), str(tmp_path / "result.json")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["ranks"] == 2
    for wiring in ("expert_parallel", "parallelize"):
        found = result[wiring]
        assert found["fingerprint_equal"], wiring
        assert not found["fingerprint_after_change_equal"], wiring  # rank 1's experts are in rank 0's digest
        for mode in ("train", "inference"):
            m = found[mode]
            assert m["experts_equal"] and m["kept_all"] and m["capacity"] is None, (wiring, m)
            # Measured 0.0 for both on this CPU; the bound is float32's (2^-13 of the largest output),
            # a tenth of what one route of another expert or gate would move.
            assert m["weights_max_diff"] <= 1e-6 and m["output_max_diff"] <= 2**-13 * m["output_max_abs"], (wiring, m)
            assert m["output_max_abs"] > 0.5, (wiring, m)

"""Audits of DeepSpeed's own MoE gate (deepspeed.moe.sharded_moe.TopKGate, deepspeed 0.19.8) through
moe_audit.deepspeed and the binary.

Needs torch and deepspeed (`DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed==0.19.8`);
without them the module is skipped with the reason. Every expected verdict comes from DeepSpeed's
source, cited as deepspeedai/DeepSpeed@v0.19.8: deepspeed/moe/sharded_moe.py:LINE ("ds:LINE"
below). Audits are small (E 8, hidden 16, batch 2 x seq_len 16, 8 trials) and served from this
process, so deepspeed is imported once.
"""

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed)")

from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.sharded_moe import TopKGate  # noqa: E402

import moe_audit  # noqa: E402
import moe_audit.deepspeed as mds  # noqa: E402

H, E = 16, 8
SIZES: dict[str, Any] = dict(batch=2, seq_len=16, trials=8)
PROBES = "PFNRDSML"
ALL_PASS = dict.fromkeys(PROBES, "pass")


def gate(k=1, **options):
    """A TopKGate with a seeded gate weight (nn.Linear's init draws from the global generator)."""
    torch.manual_seed(0)
    return TopKGate(H, E, k=k, **options)


def verdicts(proc):
    """{probe: verdict} of a JSON report that moe-audit printed."""
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    return {f["probe"]: f["verdict"] for f in report["routers"][0]["findings"]}


def audit(module, asked=None, **options):
    return moe_audit.check(mds.wrap(module, **options), **SIZES, **(asked or {})).verdicts


def expect(leaks="", inconclusive="", latent="", **others):
    """The verdict of every probe: these leak, these are inconclusive, these are latent (only the
    capacity in force changed), the rest pass."""
    found = dict(ALL_PASS, **dict.fromkeys(leaks, "leak"), **dict.fromkeys(inconclusive, "inconclusive"),
                 **dict.fromkeys(latent, "latent"))
    return dict(found, **others)


def rows(batch, seq_len, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, seq_len, H)).astype(np.float32)


# -- routes ---------------------------------------------------------------------------------------

def deepspeed_call(g, x, **attributes):
    """DeepSpeed's own answer to x [B, S, H], called as MOELayer calls the gate (ds:660-663):
    (experts [T, k] with -1 for a dropped route, gates [T, k], capacity)."""
    saved = {a: getattr(g, a) for a in attributes}
    for a, v in attributes.items():
        setattr(g, a, v)
    try:
        with torch.no_grad():
            _, capacity, _, experts, _, gates, _ = g(torch.from_numpy(x).reshape(-1, H), None, True, False)
    finally:
        for a, v in saved.items():
            setattr(g, a, v)
    return experts.t().numpy(), gates.t().double().numpy(), int(capacity)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_kept_routes_are_deepspeeds_and_dropped_ones_keep_their_expert_and_gate(k):
    g = gate(k, capacity_factor=1.0, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
    x = rows(2, 16)
    routes, capacity = mds.wrap(g).route(x, "train")
    experts, gates, ds_capacity = deepspeed_call(g, x)
    full_experts, full_gates, _ = deepspeed_call(g, x, drop_tokens=False)
    dropped = experts < 0
    assert dropped.any(), "the capacity must bind in this test"
    # ds:_capacity (152-162): ceil(32 / 8 * k) slots per expert over the whole call.
    assert capacity == ds_capacity == 4 * k
    assert np.array_equal(routes.kept, ~dropped)
    assert np.array_equal(routes.experts, full_experts)
    assert np.allclose(routes.weights[~dropped], gates[~dropped])
    assert np.allclose(routes.weights[dropped], full_gates[dropped])
    if k > 1:
        # Top-2 and top-k renormalise over the survivors (ds:386-392, 479-482): a token that lost a
        # route has kept gates summing to 1, which the pre-drop gates did not.
        lost = dropped.any(axis=1) & ~dropped.all(axis=1)
        assert np.allclose(routes.weights[lost].sum(axis=1, where=routes.kept[lost]), 1.0)
        assert not np.allclose(full_gates[lost].sum(axis=1, where=routes.kept[lost]), 1.0)


@pytest.mark.parametrize("k, options", [
    (1, dict(use_rts=True)),
    (1, dict(noisy_gate_policy="RSample")),
    (1, dict(noisy_gate_policy="Jitter")),
    (2, dict(top2_2nd_expert_sampling=True)),
], ids=["rts", "rsample", "jitter", "sampling"])
def test_a_random_gates_routes_are_deepspeeds_own_from_the_same_draws(k, options):
    g = gate(k, capacity_factor=1.0, min_capacity=0, **options)
    x = rows(2, 16)
    torch.manual_seed(7)
    routes, _ = mds.wrap(g, seed=7).route(x, "train")
    torch.manual_seed(7)
    experts, gates, _ = deepspeed_call(g, x)
    assert (experts < 0).any(), "the capacity must bind in this test"
    assert np.array_equal(routes.kept, experts >= 0)
    assert np.array_equal(routes.experts[routes.kept], experts[experts >= 0])
    assert np.allclose(routes.weights[routes.kept], gates[experts >= 0])


def test_dropless_gates_report_no_capacity():
    # drop_tokens=False: the capacity is the largest expert count (ds:248-259, 368-377), a buffer
    # size under which nothing drops.
    routes, capacity = mds.wrap(gate(2, drop_tokens=False, top2_2nd_expert_sampling=False)).route(rows(2, 16), "train")
    assert capacity is None and routes.kept.all()


def test_min_capacity_above_the_calls_tokens_routes_every_token_instead_of_asserting():
    g = gate(1, min_capacity=8, use_rts=False)
    x = rows(1, 3)
    with pytest.raises(AssertionError, match="min_capacity"):
        deepspeed_call(g, x)  # ds:278
    routes, capacity = mds.wrap(g).route(x, "train")
    assert routes.kept.all() and capacity == 8  # max(ceil(3 / 8), min_capacity), as top-2 reports it
    assert g.min_capacity == 8
    # Top-2 routes such a call without asserting: the adapter's answer is DeepSpeed's.
    g2 = gate(2, min_capacity=8, top2_2nd_expert_sampling=False)
    experts, _, ds_capacity = deepspeed_call(g2, x)
    routes, capacity = mds.wrap(g2).route(x, "train")
    assert capacity == ds_capacity == 8 and np.array_equal(routes.experts, experts)


def test_eval_mode_uses_the_eval_capacity_factor():
    g = gate(2, capacity_factor=1.0, eval_capacity_factor=2.0, min_capacity=0, top2_2nd_expert_sampling=False)
    wrapped = mds.wrap(g)
    assert wrapped.route(rows(2, 16), "train")[1] == 8
    assert wrapped.route(rows(2, 16), "inference")[1] == 16
    assert not g.training


def test_the_gate_of_an_moe_layer_is_audited_and_anything_else_refused():
    torch.manual_seed(0)
    layer = MoE(H, torch.nn.Linear(H, H), num_experts=E, k=2)
    wrapped = mds.wrap(layer)
    assert wrapped.gate is layer.deepspeed_moe.gate
    assert (wrapped.experts, wrapped.top_k, wrapped.hidden_size, wrapped.name) == (E, 2, H, "deepspeed-top2")
    assert mds.wrap(layer.deepspeed_moe).gate is wrapped.gate
    with pytest.raises(TypeError, match="expected a deepspeed TopKGate, MOELayer or MoE, got Linear"):
        mds.wrap(torch.nn.Linear(H, E))


def test_random_draws_advance_the_global_generator_once_per_call():
    # Sampling draws from torch's global generator (ds:79-86, 341): the same call twice routes
    # differently (the D probe sees it), and the dropless pass does not draw twice.
    g = gate(2, capacity_factor=1.0, min_capacity=0)
    wrapped = mds.wrap(g, seed=3)
    x = rows(2, 16)
    state = torch.random.get_rng_state()
    first, _ = wrapped.route(x, "train")
    after = torch.random.get_rng_state()
    torch.random.set_rng_state(state)
    deepspeed_call(g, x)
    assert torch.equal(after, torch.random.get_rng_state())
    second, _ = wrapped.route(x, "train")
    assert not np.array_equal(first.experts, second.experts)


def test_seed_calls_draw_the_same_noise_for_the_same_call():
    wrapped = mds.wrap(gate(2, capacity_factor=1.0, min_capacity=0), seed_calls=True)
    x = rows(2, 16)
    a, b = wrapped.route(x, "train", seed=5), wrapped.route(x, "train", seed=5)
    assert np.array_equal(a[0].experts, b[0].experts) and np.array_equal(a[0].kept, b[0].kept)
    c, _ = wrapped.route(x, "train", seed=6)
    assert not np.array_equal(a[0].experts, c.experts)


# -- audits ---------------------------------------------------------------------------------------

# name: (gate options, wrap options, check options, the verdicts predicted from the source).
CAPACITY = "PFNRL"  # one capacity over the call: the prefix, the future, the neighbours, the layout
RANDOM = expect("D", "PFNRSML")  # D says so; every other difference may be noise
RSAMPLE = dict(drop_tokens=False, use_rts=False, noisy_gate_policy="RSample")
JITTER = dict(drop_tokens=False, use_rts=False, noisy_gate_policy="Jitter")
#: name: (gate options, wrap options, check options, predicted verdicts).
AUDITS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, str]]] = {
    # Dropless and deterministic: nothing to leak. RTS draws (ds:267-274) but nothing can drop.
    "top1-dropless": (dict(drop_tokens=False, use_rts=False), {}, {}, expect()),
    "top1-dropless-rts": (dict(drop_tokens=False), {}, {}, expect()),
    "top2-dropless": (dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False), {}, {}, expect()),
    "top3-dropless": (dict(k=3, drop_tokens=False), {}, {}, expect()),
    # Capacity over the call (ds:152-162). Top-1 without RTS keeps whichever tied rows CPU topk
    # picks (ds:284); min_capacity 8 is above a prefix's tokens (ds:278, handled).
    "top1-capacity": (dict(min_capacity=0, use_rts=False), {}, {}, expect(CAPACITY)),
    "top1-capacity-inference": (dict(min_capacity=0, use_rts=False), {}, dict(mode="inference"), expect(CAPACITY)),
    "top1-min-capacity-8": (dict(min_capacity=8, use_rts=False), {}, {}, expect(CAPACITY)),
    # A capacity that never binds is still computed from the call's tokens (ds:152-162): a prefix,
    # a batch of another size and another layout state another capacity in force, no decision
    # changed: latent (docs/PROPERTIES.md).
    "top1-capacity-never-binds": (dict(capacity_factor=8.0, eval_capacity_factor=8.0, min_capacity=0, use_rts=False),
                                  {}, {}, expect(latent="PRL")),
    # The same with eval_capacity_factor left at its default 1.0: it binds in eval only (ds:575).
    "top1-capacity-binds-in-eval": (dict(capacity_factor=8.0, min_capacity=0, use_rts=False), {}, {},
                                    expect("M", latent="PRL")),
    "top2-capacity": (dict(k=2, min_capacity=0, top2_2nd_expert_sampling=False), {}, {}, expect(CAPACITY)),
    "top3-capacity": (dict(k=3, min_capacity=0), {}, {}, expect(CAPACITY)),
    # eval_capacity_factor in eval (ds:575-586): training and inference route differently.
    "top2-eval-capacity": (dict(k=2, min_capacity=0, eval_capacity_factor=2.0, top2_2nd_expert_sampling=False),
                           {}, {}, expect(CAPACITY + "M")),
    # Served (--mode inference) at eval_capacity_factor 2.0 (ds:580, 364) with DeepSpeed's default
    # min_capacity 8 (ds:533): a prefix's capacity is another than the call's (ds:152-162), and it
    # binds on none of the prefixes: P is latent (no decision changed). F, N, R and L make it
    # bind: leaks with their rates.
    "top2-eval-capacity-inference": (dict(k=2, eval_capacity_factor=2.0, top2_2nd_expert_sampling=False),
                                     {}, dict(mode="inference"), expect("FNRML", latent="P")),
    # Random: RTS (ds:267-274, both modes), second-expert sampling (ds:338-341, both modes).
    "top1-capacity-rts": (dict(min_capacity=0), {}, {}, RANDOM),
    "top1-capacity-rts-seeded": (dict(min_capacity=0), dict(seed_calls=True), {}, expect(CAPACITY)),
    "top2-capacity-sampling": (dict(k=2, min_capacity=0), {}, {}, RANDOM),
    "top2-capacity-sampling-seeded": (dict(k=2, min_capacity=0), dict(seed_calls=True), {}, expect(CAPACITY)),
    "top1-capacity-rts-inference": (dict(min_capacity=0), {}, dict(mode="inference"), RANDOM),
    "top2-capacity-sampling-inference": (dict(k=2, min_capacity=0), {}, dict(mode="inference"), RANDOM),
    "top2-dropless-sampling": (dict(k=2, drop_tokens=False), {}, {}, RANDOM),
    "top2-dropless-sampling-seeded": (dict(k=2, drop_tokens=False), dict(seed_calls=True), {}, expect()),
    # Noise only in training (ds:227-228, 570-577): seeded, only the train/inference rule differs.
    "top1-rsample": (RSAMPLE, {}, {}, RANDOM),
    "top1-rsample-seeded": (RSAMPLE, dict(seed_calls=True), {}, expect("M")),
    # Jitter multiplies the input by U(0.99, 1.01) in training (ds:55-76, 570-571): it rarely flips
    # a choice, but every gate (a combine weight) moves.
    "top1-jitter": (JITTER, {}, {}, RANDOM),
    "top1-jitter-seeded": (JITTER, dict(seed_calls=True), {}, expect("M")),
}


@pytest.mark.parametrize("name", list(AUDITS))
def test_verdicts_are_the_ones_deepspeeds_source_predicts(name):
    options, wrapping, asked, predicted = AUDITS[name]
    assert audit(gate(**options), asked, **wrapping) == predicted


def test_a_latent_finding_is_told_apart_and_fails_the_default_gate():
    # top2-eval-capacity-inference's P: the capacity in force changed, no decision did.
    g = gate(2, eval_capacity_factor=2.0, top2_2nd_expert_sampling=False)
    asked = dict(SIZES, mode="inference", probes="P")
    report = moe_audit.check(mds.wrap(g), **asked)
    assert (report.latent, report.leaks, report.exit_code) == (["P"], [], 1), report
    finding = report.findings[0]
    assert (finding.fields["affected"], finding.fields["capacity_changed"]) == (0, True), finding
    assert moe_audit.check(mds.wrap(g), **asked, fail_on="leak").exit_code == 0


def test_an_moe_layer_is_audited_through_its_gate():
    # deepspeed.moe.layer.MoE's defaults (layer.py:38-53): top-1 by default; k=2 samples its second
    # expert in both modes, so the layer's gate is random (ds:338-341).
    torch.manual_seed(0)
    assert audit(MoE(H, torch.nn.Linear(H, H), num_experts=E, k=2)) == RANDOM



@pytest.fixture(scope="module")
def rsample_in_inference():
    # RSample draws only in training (ds:575-577 passes no policy in eval): the serving path is
    # deterministic.
    return audit(gate(**RSAMPLE), dict(mode="inference"))


def test_a_gate_random_only_in_training_passes_the_inference_audit(rsample_in_inference):
    found = rsample_in_inference
    assert {p: found[p] for p in "PFNRLD"} == dict.fromkeys("PFNRLD", "pass"), found
    assert found["M"] in ("leak", "inconclusive"), found  # the training rule is random, inference's not


def test_a_gate_random_only_in_training_shows_no_state_in_the_inference_audit(rsample_in_inference):
    assert rsample_in_inference["S"] != "leak", rsample_in_inference


# -- the recipe -----------------------------------------------------------------------------------

RECIPE = """\
import torch, moe_audit.deepspeed
from deepspeed.moe.sharded_moe import TopKGate
torch.manual_seed(0)
moe_audit.deepspeed.run(TopKGate(64, 8, k=2, capacity_factor=1.0))
"""


def test_the_recipe_serves_deepspeeds_default_top2_gate_in_four_lines(tmp_path):
    # DeepSpeed logs to stdout (the accelerator it picked, here without DS_ACCELERATOR): imported
    # after moe_audit.deepspeed, its log goes to stderr and the protocol stays clean.
    script = tmp_path / "ds_router.py"
    script.write_text(RECIPE)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([moe_audit.binary(), "check", "--router-cmd", f"{sys.executable} {script}",
                           "--format", "json", *(f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items())],
                          capture_output=True, text=True, env=env, timeout=600)
    # Sampled second experts in both modes (ds:338-341): random, so D leaks and nothing else is shown.
    assert verdicts(proc) == RANDOM, proc.stderr
    assert proc.returncode == 1

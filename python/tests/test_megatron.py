"""Audits of Megatron-Core's TopKRouter as shipped, through moe_audit.megatron and the binary.

Needs torch and megatron-core (`.ci/run` installs them); without them the module is skipped with
the reason (under CI it fails: python/tests/conftest.py). Each audit runs `moe-audit check` once,
at small sizes, against a router built on the CPU from a TransformerConfig and served from this
process (moe_audit.check).

The verdicts are the ones Megatron-Core's source predicts (0.16.1 and 0.19.2: `.ci/run` runs this
module on both; file:line below are 0.16.1's `megatron/core/transformer/moe/` unless said): top-k
without capacity is per token; the capacity is computed over the whole call (`moe_utils.py:832-836`,
T = seq_len * batch) and dropping is by probability or by position over the call (844-850);
Sinkhorn balances over the call in training only (`router.py:239-248`); input jitter draws in
training and eval (`router.py:520-527`).
"""

import json
import math
import os
import re
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
pytest.importorskip("megatron.core",
                    reason="megatron-core is not installed or does not import (pip install megatron-core)")

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import moe_audit  # noqa: E402
import moe_audit.megatron as megatron  # noqa: E402

H, E = 32, 8
SIZES: dict[str, Any] = dict(batch=2, seq_len=32, trials=8)
PROBES = "PFNRDSML"
ALL_PASS = dict.fromkeys(PROBES, "pass")


def config(**more):
    options = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=2)
    options.update(more)
    return TransformerConfig(**options)


def verdicts(proc):
    """{probe: verdict} of a JSON report that moe-audit printed."""
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)
    return {f["probe"]: f["verdict"] for f in report["routers"][0]["findings"]}


def audit(router, **options):
    return moe_audit.check(router, **SIZES, **options).verdicts


def leaking(found, verdict="leak"):
    return "".join(p for p in PROBES if found.get(p) == verdict)


CAPACITY = dict(moe_expert_capacity_factor=1.0)
SIGMOID_GROUPS = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5)
SINKHORN = dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0)
JITTER = dict(moe_input_jitter_eps=0.1)

# (name, config options, wrap options, check arguments, the probes that leak).
CASES = [
    ("softmax top-2, dropless", {}, {}, {}, ""),
    ("softmax before top-1, dropless", dict(moe_router_topk=1, moe_router_pre_softmax=True), {}, {}, ""),
    ("sigmoid, expert bias, groups", SIGMOID_GROUPS, {}, {}, ""),
    ("capacity 1.0, probs", CAPACITY, {}, {}, "PFNRL"),
    # F leaks only because CPU torch.topk over the 0/1 map keeps arbitrary tied rows: later
    # tokens decide which earlier ones survive (first come first served would pass F).
    ("capacity 1.0, position", dict(CAPACITY, moe_token_drop_policy="position"), {}, {}, "PFNRL"),
    ("capacity 1.0, probs, pad to capacity", dict(CAPACITY, moe_pad_expert_input_to_capacity=True), {}, {}, "PFNRL"),
    # Never binding, but computed from the call's tokens: the capacity in force alone changes
    # (latent P R L: LATENT below).
    ("capacity 8.0 (never binding)", dict(moe_expert_capacity_factor=8.0), {}, {}, ""),
    ("sinkhorn", SINKHORN, {}, {}, "PFNRML"),
    ("sinkhorn, --mode inference", SINKHORN, {}, dict(mode="inference"), "M"),
    ("capacity 1.0, probs, --mode inference", CAPACITY, {}, dict(mode="inference"), "PFNRL"),
    ("softmax top-2, --mode inference", {}, {}, dict(mode="inference"), ""),
    ("input jitter 0.1", JITTER, {}, {}, "D"),
    ("input jitter 0.1, seed_calls", JITTER, dict(seed_calls=True), {}, ""),
    ("input jitter 0.1, --mode inference", JITTER, {}, dict(mode="inference"), "D"),
]


#: The cases whose capacity in force changes while no decision does: those probes are latent.
LATENT = {"capacity 8.0 (never binding)": "PRL"}


@pytest.mark.parametrize("name,more,options,asked,leaks", CASES, ids=[c[0] for c in CASES])
def test_verdicts_are_the_ones_megatrons_source_predicts(name, more, options, asked, leaks):
    router = megatron.wrap(config(**more), **options)
    if "moe_router_enable_expert_bias" in more:
        with torch.no_grad():
            router.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    found = audit(router, **asked)
    assert leaking(found) == leaks, found
    assert leaking(found, "latent") == LATENT.get(name, ""), found
    if leaks == "D":
        # A random router: D says so, the others are within its noise.
        assert all(v in ("inconclusive", "pass") for p, v in found.items() if p != "D"), found


def megatron_outputs(router, data, mode="train"):
    """What the router returns for data [batch, seq_len, hidden], called as MoELayer calls it."""
    router.router.train(mode == "train")
    x = torch.from_numpy(np.ascontiguousarray(data.transpose(1, 0, 2)))
    with torch.no_grad(), megatron.on_device(router.device):
        probs, routing_map = router.router(x)
    return probs.numpy(), routing_map.numpy()


def test_routes_are_megatrons_in_moe_audit_token_order_and_choice_order():
    router = megatron.wrap(config(**SIGMOID_GROUPS))
    with torch.no_grad():
        router.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
    batch, seq_len = 3, 5
    x = np.random.default_rng(1).standard_normal((batch, seq_len, H)).astype(np.float32)
    routes, capacity = router.route(x, "train")
    probs, routing_map = megatron_outputs(router, x)
    assert capacity is None and routes.kept.all()
    for b in range(batch):
        for s in range(seq_len):
            # Megatron's row s * batch + b is moe-audit's token b * seq_len + s.
            row, t = s * batch + b, b * seq_len + s
            assert set(routes.experts[t]) == set(np.flatnonzero(routing_map[row]))
            assert np.allclose(routes.weights[t], probs[row, routes.experts[t]])
    # Choice order: probability descending (Megatron's map has none).
    assert (np.diff(routes.weights, axis=1) <= 0).all()


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_dropped_routes_and_capacity_are_megatrons(policy, pad):
    router = megatron.wrap(config(moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy,
                                  moe_pad_expert_input_to_capacity=pad))
    batch, seq_len, k = 2, 16, 2
    x = np.random.default_rng(2).standard_normal((batch, seq_len, H)).astype(np.float32)
    routes, capacity = router.route(x, "train")
    probs, routing_map = megatron_outputs(router, x)
    # get_capacity (moe_utils.py:193-211): ceil(T * k / E * cf) over the whole call.
    assert capacity == math.ceil(batch * seq_len * k / E * 1.0) == 8
    assert not routes.kept.all(), "the capacity must bind in this test"
    experts, kept = routes.experts.reshape(batch, seq_len, k), routes.kept.reshape(batch, seq_len, k)
    rows = routing_map.reshape(seq_len, batch, E)
    for b in range(batch):
        for s in range(seq_len):
            assert [bool(rows[s, b, e]) for e in experts[b, s]] == kept[b, s].tolist()
    # Every token keeps its k routes in the record (pad rows are not routes), and no expert
    # keeps more than the capacity.
    assert routes.experts.shape == (batch * seq_len, k)
    loads = np.bincount(routes.experts[routes.kept], minlength=E)
    assert loads.max() <= capacity
    if not pad:
        assert np.array_equal(loads, routing_map.sum(0))
    # A dropped route keeps the probability it had before dropping (Megatron does not
    # renormalise the kept ones either, moe_utils.py:860-861).
    unlimited, _ = megatron.wrap(config()).route(x, "train")
    assert np.array_equal(routes.experts, unlimited.experts)
    assert np.allclose(routes.weights, unlimited.weights)


def test_position_policy_on_the_cpu_keeps_tied_rows_that_are_not_the_earliest():
    # torch.topk over the 0/1 map (moe_utils.py:846-850): every routed row ties. Measured on
    # the CPU: an expert's kept rows are not its first C routed rows in Megatron's [S, B] order.
    router = megatron.wrap(config(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"))
    x = np.random.default_rng(3).standard_normal((2, 32, H)).astype(np.float32)
    _, before = megatron_outputs(megatron.wrap(config()), x)
    _, after = megatron_outputs(router, x)
    capacity = math.ceil(2 * 32 * 2 / E)
    earliest = np.zeros_like(before)
    for e in range(E):
        earliest[np.flatnonzero(before[:, e])[:capacity], e] = True
    assert (after.sum(0) == np.minimum(before.sum(0), capacity)).all()
    assert not np.array_equal(after, earliest)


def test_padding_goes_to_megatron_and_padding_tokens_are_routed():
    router = megatron.wrap(config(**CAPACITY))
    assert router.padding_mask
    x = np.random.default_rng(4).standard_normal((2, 4, H)).astype(np.float32)
    padding = np.array([[0, 0, 1, 1], [0, 0, 0, 1]], dtype=bool)
    routes, _ = router.route(x, "train", padding=padding)
    unpadded, _ = router.route(x, "train")
    # Megatron masks only its aux losses with padding_mask: the routes are the same.
    assert np.array_equal(routes.experts, unpadded.experts) and np.array_equal(routes.kept, unpadded.kept)
    assert not megatron.wrap(config(), protocol=1).padding_mask


def test_wrap_takes_a_config_a_router_or_a_module_holding_one_on_the_cpu():
    built = megatron.wrap(config(), seed=3)
    again = megatron.wrap(config(), seed=3)
    assert torch.equal(built.router.weight, again.router.weight)
    assert not torch.equal(built.router.weight, megatron.wrap(config(), seed=4).router.weight)
    assert isinstance(built.router, TopKRouter) and built.name == "megatron-top2"
    holder = torch.nn.Sequential(torch.nn.Identity(), built.router)
    found = megatron.wrap(holder)
    assert found.router is built.router and found.path == "1"
    assert (found.experts, found.top_k, found.hidden_size) == (E, 2, H)
    with pytest.raises(TypeError, match="no TopKRouter in Linear"):
        megatron.wrap(torch.nn.Linear(4, 4))
    with pytest.raises(TypeError, match="give a TransformerConfig"):
        megatron.wrap("router")
    # No CUDA: the gate stays on the CPU after a call, and torch.cuda is as it was.
    current_device = torch.cuda.current_device
    built.route(np.zeros((1, 2, H), dtype=np.float32), "train")
    if not torch.cuda.is_available():
        assert built.router.weight.device.type == "cpu"
    assert torch.cuda.current_device is current_device


# Quantile balancing, new in Megatron-Core 0.19 (NVIDIA/Megatron-LM core_v0.19.0
# megatron/core/transformer/moe/, router.py and moe_utils.py as PyPI's 0.19.2 ships them). .ci/run
# runs these on Python 3.12 with 0.19.2 and deselects them in its 0.16.1 run; elsewhere without
# 0.19 they skip (and fail under CI, python/tests/conftest.py).
QUANTILE = dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0)


def megatron_0_19(test):
    return pytest.mark.megatron_core_0_19(pytest.mark.skipif(
        not hasattr(TopKRouter, "quantile_balancing"),
        reason="megatron-core 0.19 is not installed (quantile balancing is new in 0.19)")(test))


def quantile_router():
    router = megatron.wrap(config(**QUANTILE))
    with torch.no_grad():
        router.router.qb_beta.copy_(torch.linspace(-0.5, 0.5, E))
    return router


@megatron_0_19
def test_quantile_balancing_routes_per_token_on_the_bias_it_has():
    # router.py:310-384 with qb_dual_update (moe_utils.py:203-240): the top-k of logits - qb_beta,
    # token by token. The column quantile that moves qb_beta is only accumulated in training with
    # gradients (router.py:338, 357-364) and applied at the global-batch boundary, never in the call.
    router = quantile_router()
    assert router.name == "megatron-top2-quantile-balancing"
    x = np.random.default_rng(5).standard_normal((2, 8, H)).astype(np.float32)
    routes, capacity = router.route(x, "train")
    logits = torch.from_numpy(x.reshape(-1, H)) @ router.router.weight.T
    chosen = (logits - router.router.qb_beta).topk(2, dim=1).indices.numpy()
    assert capacity is None and routes.kept.all()
    assert [set(e) for e in routes.experts] == [set(e) for e in chosen]
    # The bias decides: without it some token routes elsewhere.
    assert [set(e) for e in chosen] != [set(e) for e in logits.topk(2, dim=1).indices.numpy()]
    assert audit(router) == ALL_PASS
    assert torch.equal(router.router.qb_beta, torch.linspace(-0.5, 0.5, E)) and router.router.qb_beta_count == 0


@megatron_0_19
def test_quantile_balancing_is_given_no_padding_mask_which_megatron_refuses():
    # router.py:768-771: routing() asserts that a quantile-balancing router gets no padding_mask.
    router = quantile_router()
    assert not router.padding_mask
    x = np.random.default_rng(6).standard_normal((2, 4, H)).astype(np.float32)
    padding = np.array([[0, 0, 1, 1], [0, 0, 0, 1]], dtype=bool)
    mask = torch.from_numpy(padding.T.copy())
    with pytest.raises(AssertionError, match="does not support padding masks"), megatron.on_device(router.device):
        router.router(torch.from_numpy(x.transpose(1, 0, 2).copy()), padding_mask=mask)
    routes, _ = router.route(x, "train", padding=padding)
    unpadded, _ = router.route(x, "train")
    assert np.array_equal(routes.experts, unpadded.experts) and routes.kept.all()


def test_the_five_line_recipe_serves_the_router_to_moe_audit_check_router_cmd(tmp_path):
    # The module docstring's recipe, as a user's script: moe-audit starts it (a fresh Python
    # that imports megatron-core) and audits it over stdin/stdout.
    found = re.search(r"::\n\n(.*?)\n\nserves", megatron.__doc__ or "", re.S)
    assert found, "the module docstring's recipe"
    recipe = found.group(1)
    lines = [line for line in recipe.splitlines() if line.strip()]
    assert len(lines) <= 5, recipe
    script = tmp_path / "router.py"
    script.write_text("\n".join(line[4:] for line in recipe.splitlines()) + "\n")
    package = os.path.dirname(os.path.dirname(moe_audit.__file__))  # the moe_audit this test imports
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package, os.environ.get("PYTHONPATH", "")]))
    command = [moe_audit.binary(), "check", "--router-cmd", f"{sys.executable} {script}", "--format", "json",
               *(f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items())]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert leaking(verdicts(proc)) == "PFNRL", proc.stdout


def test_a_router_taken_from_a_gpt_model_built_on_the_cpu():
    # A whole GPTModel needs Megatron's parallel state: one process, a gloo group, torn down after.
    import socket

    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        torch.manual_seed(0)
        # The allgather dispatcher: alltoall makes a CUDA stream in its constructor.
        model = GPTModel(config(num_layers=2, use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
                                **CAPACITY), get_gpt_layer_local_spec(num_experts=E), vocab_size=64,
                         max_sequence_length=64)
        first = megatron.wrap(model)
        second = megatron.wrap(model, path="decoder.layers.1.mlp.router")
        assert first.path == "decoder.layers.0.mlp.router" and second.router is model.decoder.layers[1].mlp.router
        with pytest.raises(ValueError, match="no TopKRouter at 'decoder.layers.2.mlp.router'.*'decoder.layers.1"):
            megatron.wrap(model, path="decoder.layers.2.mlp.router")
        assert leaking(audit(second)) == "PFNRL"
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()

"""A TorchTitan MoE layer run expert-parallel through moe_audit.torchtitan's driver, compared on
rank 0 with the same layer at EP 1 (test_torchtitan.py launches it):

    OMP_NUM_THREADS=1 python3 -m torch.distributed.run --standalone --nproc_per_node N torchtitan_ep.py OUT

The layer is wired over the ranks two ways: by moe_audit.torchtitan.expert_parallel (each rank
keeps its rows of the routed experts' weights) and by TorchTitan's own `moe.parallelize`
(ParallelDims with ep = N: DTensor expert weights sharded over the `ep` mesh). Each is seeded the
same and routes this rank's consecutive slice of one fixed batch in both modes; rank 0 gathers
routes and output rows and routes the whole batch through an EP-1 copy built the same way. Rank 0
writes one JSON object to OUT (under a launcher moe_audit.distributed moves stdout to stderr): per
wiring, the largest differences and whether the fingerprints agree (also after one weight of the
last rank's experts is changed).

`build` is also the single-process tests' layer. File:line references are torchtitan 0.3.0's.
"""

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401 (the "fake" backend, below)
import torchtitan.distributed.parallel_dims as parallel_dims
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.moe_sharding import set_moe_sharding_config
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

import moe_audit.torchtitan as mtt

EXPERTS, HIDDEN, FFN, TOP_K = 8, 32, 48, 2
BATCH, SEQ = 4, 16


def config(*, experts=EXPERTS, top_k=TOP_K, score_func="softmax", route_norm=True, route_scale=1.0,
           load_balance_coeff=1e-3):
    """A MoE config as TorchTitan's model configs write one (models/common/moe.py: router, grouped
    experts, the all-to-all dispatcher, which routes locally until an `ep` mesh is wired)."""
    return MoE.Config(
        num_experts=experts,
        load_balance_coeff=load_balance_coeff,
        router=TokenChoiceTopKRouter.Config(
            num_experts=experts, gate=Linear.Config(in_features=HIDDEN, out_features=experts), top_k=top_k,
            score_func=score_func, route_norm=route_norm, route_scale=route_scale),
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=HIDDEN, hidden_dim=FFN, num_experts=experts),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)))


def build(seed=0, **options):
    """The layer of config(**options), its weights seeded."""
    return mtt.seed_weights(config(**options).build(), seed)


def parallelized(ranks):
    """The layer as TorchTitan's trainer spreads it (expert parallelism borrows the dp_shard ranks),
    on the CPU: TorchTitan falls back to device "cuda" without an accelerator (tools/utils.py:55),
    which its mesh is then built on (distributed/parallel_dims.py:281), and its size-1 mesh
    dimensions use the "fake" backend (parallel_dims.py:259-262), registered by fake_pg's import."""
    parallel_dims.device_type = "cpu"
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=ranks, cp=1, tp=1, pp=1, ep=ranks, world_size=ranks,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    cfg = config()
    # The layout TorchTitan's own models pass (moe_sharding.py:320-325).
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                            expert_param_layout={"w1_EFD": Shard(1), "w2_EDF": Shard(2), "w3_EFD": Shard(1)})
    moe = cfg.build()
    moe.parallelize(dims)
    return mtt.seed_weights(moe, 1)


def gathered(local):
    """Every rank's arrays of one Local, concatenated in rank order (on every rank)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (local.experts, local.weights, local.kept, local.output))
    return [torch.cat([torch.from_numpy(p[i]) for p in parts]) for i in range(4)]


def main(out):
    set_spmd_backend("partial_dtensor")  # EP on gloo (moe_audit/torchtitan.py's docstring)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("ep",))
    reference = mtt.wrap(build(seed=1))
    # Sliced first, seeded after: each rank draws the same global weights and keeps its rows.
    layers = {"expert_parallel": mtt.seed_weights(mtt.expert_parallel(build(seed=2), mesh), 1),
              "parallelize": parallelized(ranks)}
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=torch.Generator().manual_seed(7))
    share = BATCH // ranks
    result: dict[str, Any] = {"ranks": ranks}
    for wiring, moe in layers.items():
        layer = mtt.wrap(moe)
        found: dict[str, Any] = {"fingerprint_equal": layer.fingerprint() == reference.fingerprint()}
        for mode in ("train", "inference"):
            experts, weights, kept, output = gathered(layer.forward(hidden[rank * share:(rank + 1) * share], mode,
                                                                    None))
            ref = reference.forward(hidden, mode, None)
            found[mode] = {
                "experts_equal": torch.equal(experts, torch.from_numpy(ref.experts)),
                "kept_all": bool(kept.all()) and ref.kept.all().item(),
                "weights_max_diff": (weights - torch.from_numpy(ref.weights)).abs().max().item(),
                "output_max_diff": (output - torch.from_numpy(ref.output)).abs().max().item(),
                "output_max_abs": output.abs().max().item(),
                "capacity": ref.capacity,
            }
        w2 = moe.routed_experts.inner_experts.w2_EDF
        if rank == ranks - 1:  # the last expert, held by the last rank only
            with torch.no_grad():
                (w2.to_local() if hasattr(w2, "to_local") else w2)[-1, 0, 0] += 1.0
        found["fingerprint_after_change_equal"] = layer.fingerprint() == reference.fingerprint()
        result[wiring] = found
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1])

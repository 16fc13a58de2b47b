"""Audit a TorchTitan MoE layer expert-parallel, as training runs it: every rank of a
`torch.distributed.run` launch builds the layer, keeps its share of the experts and routes its own
sequences; rank 0 speaks to moe-audit. TorchTitan's token-choice router is dropless (its
load-balancing bias only moves the choice), so no probe finds a leak:

    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_torchtitan.py"   # exit 0

Needs torch and torchtitan (`pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3` and
`pip install tyro`). The same file at `--nproc_per_node 1`, 2 or 4 builds the same layer
(`seed_weights` draws every weight at its global shape, each rank keeps its rows), so launches of
different sizes send the same weights fingerprint. Replace the config by your model's MoE config
and `seed_weights` by loading its checkpoint.
"""

# First: under the launcher it keeps stdout for the protocol, before anything can print there.
import moe_audit.torchtitan as mtt  # isort: split

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

EXPERTS, HIDDEN, FFN, TOP_K = 8, 64, 128, 2

moe = MoE.Config(
    num_experts=EXPERTS,
    router=TokenChoiceTopKRouter.Config(
        num_experts=EXPERTS, gate=Linear.Config(in_features=HIDDEN, out_features=EXPERTS), top_k=TOP_K,
        score_func="softmax", route_norm=True),
    routed_experts=RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=HIDDEN, hidden_dim=FFN, num_experts=EXPERTS),
        token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=EXPERTS, top_k=TOP_K)),
).build()
mtt.seed_weights(moe, seed=0)

set_spmd_backend("partial_dtensor")  # the functional all_to_all_single, which gloo runs
dist.init_process_group("gloo")
mtt.expert_parallel(moe, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
mtt.run(moe)

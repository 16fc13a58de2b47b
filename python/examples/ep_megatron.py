"""A Megatron-Core MoE layer audited as training runs it: expert-parallel over the ranks of a
``torch.distributed.run`` launch, each rank routing its own sequences (docs/DISTRIBUTED.md).

The script builds the layer as a training script does (process groups, model-parallel seed,
``get_moe_module_spec``) and hands it to ``moe_audit.megatron.run``. With a capacity factor
Megatron computes the capacity per rank over that rank's tokens (megatron-core 0.16.1
``transformer/moe/router.py:587-595``, ``moe_utils.py:830-836``), so which sequences share a rank
decides who is dropped::

    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_megatron.py"   # exit 1: P F N R L leak
    moe-audit check --router-cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_megatron.py --dropless"   # exit 0

Options: ``--dropless`` (no capacity factor), ``--dispatcher alltoall|allgather``,
``--placement contiguous|strided`` (how a call's sequences are spread over the ranks),
``--capacity-factor F``, ``--ep N`` (default: every rank). Needs torch and megatron-core; runs on a CPU (gloo) or GPUs (nccl).
"""

import argparse

# First: under the launcher it keeps stdout for the protocol, before anything can print there.
import moe_audit.megatron  # isort: split

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

parser = argparse.ArgumentParser()
parser.add_argument("--dropless", action="store_true")
parser.add_argument("--dispatcher", default="alltoall", choices=["alltoall", "allgather"])
parser.add_argument("--placement", default="contiguous", choices=["contiguous", "strided"])
parser.add_argument("--capacity-factor", type=float, default=1.0)
parser.add_argument("--ep", type=int, help="expert-parallel size (default: the world size)")
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
ep = args.ep or dist.get_world_size()
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
torch.manual_seed(0)  # the same router weight on every rank

config = TransformerConfig(
    num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=8,
    moe_router_topk=2, moe_ffn_hidden_size=128, expert_model_parallel_size=ep,
    moe_token_dispatcher_type=args.dispatcher, use_cpu_initialization=True, add_bias_linear=False,
    moe_expert_capacity_factor=None if args.dropless else args.capacity_factor,
    moe_token_drop_policy="probs", moe_aux_loss_coeff=0.0)
layer = build_module(get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False), config=config)
moe_audit.megatron.seed_experts(layer, seed=0)  # the same layer at any EP size
moe_audit.megatron.run(layer, placement=args.placement)

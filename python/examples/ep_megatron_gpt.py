"""A Megatron-Core GPTModel with MoE layers audited on token ids as training runs it:
expert-parallel over the ranks of a ``torch.distributed.run`` launch, each rank running its own
slice of the batch (docs/DISTRIBUTED.md).

The script builds the model as a training script does (process groups, model-parallel seed,
``get_gpt_layer_local_spec``) and hands it to ``moe_audit.megatron.run``, which serves it to
``moe-audit model --cmd``. With a capacity factor every MoE layer computes its capacity per rank
over that rank's tokens (megatron-core 0.16.1 ``transformer/moe/router.py:587-595``)::

    moe-audit model --cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_megatron_gpt.py" --batch 4 --seq-len 32 --trials 4   # exit 1: P F N R leak
    moe-audit model --cmd "python3 -m torch.distributed.run --standalone --nproc_per_node 2 python/examples/ep_megatron_gpt.py --dropless" --batch 4 --seq-len 32 --trials 4   # exit 0

Options: ``--dropless`` (no capacity factor), ``--layers N`` (every one an MoE layer). Needs torch
and megatron-core; runs on a CPU (gloo) or GPUs (nccl).
"""

import argparse

# First: under the launcher it keeps stdout for the protocol, before anything can print there.
import moe_audit.megatron  # isort: split

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

parser = argparse.ArgumentParser()
parser.add_argument("--dropless", action="store_true")
parser.add_argument("--layers", type=int, default=2)
args = parser.parse_args()

dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
ep = dist.get_world_size()
parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=ep)
tensor_parallel.model_parallel_cuda_manual_seed(1234)
torch.manual_seed(0)  # the same dense weights and routers on every rank

config = TransformerConfig(
    num_layers=args.layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_moe_experts=8,
    moe_router_topk=2, moe_ffn_hidden_size=128, expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
    use_cpu_initialization=True, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
    moe_expert_capacity_factor=None if args.dropless else 1.0, moe_token_drop_policy="probs", moe_aux_loss_coeff=0.0)
model = GPTModel(config, get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), vocab_size=128,
                 max_sequence_length=128)
moe_audit.megatron.run(model)

"""A Hugging Face transformers MoE block audited as it is: Mixtral's sparse MoE block, tiny.

Token choice without capacity: no leak. Needs torch and transformers (pip install "moe-audit[hf]"):

    moe-audit check --router-cmd "python3 python/examples/hf_router.py"   # exit 0

Any covered block or router works the same way (moe_audit.hf lists them); the gate, built from a
config, is seeded.
"""

from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

import moe_audit.hf

config = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
moe_audit.hf.run(MixtralSparseMoeBlock(config))

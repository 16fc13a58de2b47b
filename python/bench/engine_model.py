"""A tiny Qwen3-MoE checkpoint for a vLLM server on this CPU (issue #47, docs/engines/vllm-0.28-cpu.md): 4 layers,
hidden 128, 8 experts, top 2, vocabulary 1024, random weights (seed 0), float32, saved with
safetensors, and a word-level tokenizer whose tokens are `t0` .. `t1023` (one id each, no merges):
the audit sends token ids, but a server that loads a tokenizer rejects an id outside the vocabulary
with a 400, where one started with `--skip-tokenizer-init` lets it reach the embedding and its engine
dies (vllm 0.28.0 `v1/engine/input_processor.py:484-511` checks only with a tokenizer). The config
is the README's model (python/bench/hf_model_time.py) with 8 experts and top 2, so that a changed
decision is one of few; hidden and MoE intermediate are multiples of 32, as vLLM's CPU MoE kernel
requires (vllm 0.28.0 `experts/cpu_moe.py:191-198`).

    /work/engine-venv/bin/python python/bench/engine_model.py DIR
"""

import sys


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: engine_model.py DIR")
    import tokenizers
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Qwen3MoeConfig(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=256,
        vocab_size=1024,
        max_position_embeddings=4096,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(sys.argv[1], safe_serialization=True)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(sys.argv[1])
    print(sys.argv[1])


if __name__ == "__main__":
    main()

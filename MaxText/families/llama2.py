"""Llama 2 and 3 (and 3.1 with rope_type=llama3.1): Llama's own layer and Hugging Face's Llama format."""

from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

FAMILY = Family(
  "llama2",
  "MaxText.layers.llama:LlamaDecoderLayer",
  hf_families.llama_like("llama", "LlamaForCausalLM"),
  summary="(RMSNorm, RoPE incl. Llama 3.1 scaling, GQA, SwiGLU)",
  hf_examples={
    # Llama 3.1 RoPE scaling, 6 query heads over 2 KV heads, untied; saved in shards.
    "llama": HFExample(
      SMALL
      | {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}
      | {"rope_scaling": LLAMA3_ROPE | {"original_max_position_embeddings": 16, "rope_theta": 5000.0}},
      max_shard_size="40KB",
    ),
  },
)

"""Gemma: Llama's structure with Gemma's norms, scaled embeddings, GeGLU and a tied output (Hugging Face's Gemma)."""

from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family

FAMILY = Family(
  "gemma",
  "MaxText.layers.gemma:GemmaDecoderLayer",
  hf_families.llama_like("gemma", "GemmaForCausalLM", gelu=True, tied_by_default=True),
  summary="RMSNorm weights as offsets from 1, embeddings scaled by sqrt(emb_dim), GeGLU, tied output",
  hf_examples={
    # Multi-query attention, tied.
    "gemma": HFExample(SMALL | {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}),
  },
)

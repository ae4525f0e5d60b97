"""GPT-3, i.e. GPT-2's architecture (learned positions, no RoPE), and Hugging Face's GPT-2 format (Conv1D weights,
a fused c_attn)."""

from collections.abc import Mapping

from MaxText.common_types import Config
from MaxText.convert import hf_families
from MaxText.convert.hf_families import HFExample
from MaxText.families import Family, no_checks


def read(config_json: Mapping) -> dict:
  emb, heads = config_json["n_embd"], config_json["n_head"]
  if emb % heads:
    raise hf_families.unsupported(f"n_embd={emb} is not a multiple of n_head={heads}")
  act = config_json.get("activation_function", "gelu_new")
  if act not in hf_families.TANH_GELUS:
    raise hf_families.unsupported(f"activation_function={act!r} is not supported; only the tanh GELU (gelu_new)")
  if not config_json.get("scale_attn_weights", True) or config_json.get("scale_attn_by_inverse_layer_idx"):
    raise hf_families.unsupported("scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true is not supported")
  if config_json.get("tie_word_embeddings") is False:
    raise hf_families.unsupported("tie_word_embeddings=false is not supported for gpt2")
  return {
    "base_emb_dim": emb,
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,
    "base_mlp_dim": config_json.get("n_inner") or 4 * emb,
    "base_num_decoder_layers": config_json["n_layer"],
    "head_dim": emb // heads,
    "vocab_size": config_json["vocab_size"],
    "mlp_activations": ["gelu"],
    "normalization_layer_epsilon": float(config_json.get("layer_norm_epsilon", 1e-5)),
    "logits_via_embedding": True,
    "trainable_position_size": config_json["n_positions"],
  }


def write(cfg: Config) -> dict:
  return {
    "n_embd": cfg.emb_dim,
    "n_head": cfg.num_query_heads,
    "n_layer": cfg.num_decoder_layers,
    "n_inner": cfg.mlp_dim,
    "n_positions": cfg.trainable_position_size,
    "layer_norm_epsilon": cfg.normalization_layer_epsilon,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
  }


def layout(cfg: Config) -> hf_families.Layout:
  heads, hd = cfg.num_query_heads, cfg.head_dim
  model = [
    hf_families.same("transformer.wte.weight", "token_embedder.embedding"),
    hf_families.same("transformer.wpe.weight", "position_embedder.embedding"),
    hf_families.same("transformer.ln_f.weight", "decoder_norm.scale"),
    hf_families.same("transformer.ln_f.bias", "decoder_norm.bias"),
  ]
  p = "transformer.h.{i}."
  qkv = ("self_attention.query", "self_attention.key", "self_attention.value")
  layer = [
    hf_families.same(p + "ln_1.weight", "pre_self_attention_layer_norm.scale"),
    hf_families.same(p + "ln_1.bias", "pre_self_attention_layer_norm.bias"),
    hf_families.fused_qkv(p + "attn.c_attn.weight", tuple(f"{n}.kernel" for n in qkv), heads, hd),
    hf_families.fused_qkv(p + "attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), heads, hd),
    hf_families.conv1d_in(p + "attn.c_proj.weight", "self_attention.out.kernel", (heads, hd)),
    hf_families.same(p + "attn.c_proj.bias", "self_attention.out.bias"),
    hf_families.same(p + "ln_2.weight", "post_self_attention_layer_norm.scale"),
    hf_families.same(p + "ln_2.bias", "post_self_attention_layer_norm.bias"),
    hf_families.same(p + "mlp.c_fc.weight", "mlp.wi_0.kernel"),
    hf_families.same(p + "mlp.c_fc.bias", "mlp.wi_0.bias"),
    hf_families.same(p + "mlp.c_proj.weight", "mlp.wo.kernel"),
    hf_families.same(p + "mlp.c_proj.bias", "mlp.wo.bias"),
  ]
  return model, layer


def ignored(name: str, cfg: Config) -> bool:
  """GPT-2 checkpoints also carry the attention's causal-mask buffers (`attn.bias`, `attn.masked_bias`)."""
  causal_mask = name.endswith(".attn.bias") and ".c_attn." not in name
  return causal_mask or name.endswith("attn.masked_bias") or hf_families.not_parameters(name, cfg)


FAMILY = Family(
  "gpt3",
  "MaxText.layers.gpt3:Gpt3DecoderLayer",
  hf_families.HFMapping("gpt2", "GPT2LMHeadModel", read, write, layout, ignored),
  check=no_checks,  # No RoPE: learned positions (trainable_position_size).
  summary=(
    "GPT-2's architecture: LayerNorm with bias, GELU MLP, biases, learned positions (`trainable_position_size`), no RoPE"
  ),
  hf_examples={
    # 3 heads, learned positions, biases; unrolled layers.
    "gpt2": HFExample({"vocab_size": 96, "n_embd": 36, "n_layer": 3, "n_head": 3, "n_positions": 64}, scan_layers=False),
  },
)

"""The decoder-only Transformer and the registry of decoder layers.

Adding a model family: one file in layers/ with its decoder layer, one entry in DECODER_BLOCKS, one yml in
configs/models/.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.layers.attentions import soft_cap
from MaxText.layers.embeddings import Embed
from MaxText.layers.gemma import GemmaDecoderLayer
from MaxText.layers.gemma2 import Gemma2DecoderLayer
from MaxText.layers.gpt3 import Gpt3DecoderLayer
from MaxText.layers.linears import DenseGeneral
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.layers.mistral import MistralDecoderLayer
from MaxText.layers.qwen3 import Qwen3DecoderLayer
from MaxText.pyconfig import Config, ConfigError

DECODER_BLOCKS = {
  "llama2": LlamaDecoderLayer,  # Llama 2 and 3 (and 3.1 with rope_type=llama3.1)
  "mistral": MistralDecoderLayer,
  "gemma": GemmaDecoderLayer,
  "gemma2": Gemma2DecoderLayer,
  "qwen3": Qwen3DecoderLayer,
  "gpt3": Gpt3DecoderLayer,
}

_SAVE_NAMES = {
  "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
  "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
  "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
  "save_out_proj": ("out_proj",),
}


def remat_policy(name: str):
  """jax.checkpoint policy of MaxText's `remat_policy` names, over the checkpoint_name()s in the layers.

  full recomputes everything in the backward pass; minimal saves matmul outputs without batch dims;
  save_* keep only the named projections; none is handled by not wrapping in remat at all.
  """
  if name == "full":
    return jax.checkpoint_policies.nothing_saveable
  if name == "minimal":
    return jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
  if name in _SAVE_NAMES:
    return jax.checkpoint_policies.save_only_these_names(*_SAVE_NAMES[name])
  raise ConfigError(f"remat_policy={name!r} is not supported; choose full, minimal, none or one of {sorted(_SAVE_NAMES)}")


def decoder_block(config: Config) -> type[nn.Module]:
  try:
    return DECODER_BLOCKS[config.decoder_block]
  except KeyError:
    raise ConfigError(f"decoder_block={config.decoder_block!r} is unknown; choose one of {sorted(DECODER_BLOCKS)}") from None


class Transformer(nn.Module):
  """Token ids -> next-token logits.

  tokens, segment_ids, positions: [batch, length] int32 (segment 0 is padding; positions restart per
  document) -> logits [batch, length, vocab] in the activation dtype. `input_embeddings` [batch, length,
  embed], when given, replaces the token lookup (tests take gradients with respect to it).

  Decoding (`model_mode`, see common_types) returns (logits, kv) instead. Prefill: kv = (keys, values)
  of every layer, [layers, batch, length, kv_heads, head_dim] each. Autoregressive: length is 1, `cache`
  is (keys, values) [layers, batch, cache_len, kv_heads, head_dim] with `cache_mask` [batch, cache_len]
  marking each row's filled slots and `cache_positions` [batch, cache_len] their token positions, and kv
  is the new token's (keys, values), [layers, batch, 1, kv_heads, head_dim], for the caller to write into
  the cache.
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  model_mode: str = ct.MODEL_MODE_TRAIN

  @nn.compact
  def __call__(
    self,
    tokens,
    segment_ids,
    positions,
    deterministic: bool = True,
    input_embeddings=None,
    cache=None,
    cache_mask=None,
    cache_positions=None,
  ):
    cfg, mode = self.config, self.model_mode
    family = decoder_block(cfg)
    embed = Embed(cfg, name="token_embedder")
    x = embed(tokens) if input_embeddings is None else input_embeddings
    if family.scale_embeddings:
      x = x * jnp.asarray(cfg.emb_dim**0.5, x.dtype)
    if cfg.trainable_position_size > 0:
      x = x + Embed(cfg, cfg.trainable_position_size, name="position_embedder")(positions)
    x = sharding.constrain(x, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), self.mesh, cfg)

    block = family
    if cfg.remat_policy != "none" and mode == ct.MODEL_MODE_TRAIN:
      block = nn.remat(block, policy=remat_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
    deterministic = deterministic or not cfg.enable_dropout or cfg.dropout_rate == 0.0
    if cfg.scan_layers:
      scanned = nn.scan(
        block,
        variable_axes={"params": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, nn.broadcast, 0),
        length=cfg.num_decoder_layers,
        metadata_params={nn.PARTITION_NAME: ct.LAYERS},
      )
      layers = scanned(cfg, self.mesh, deterministic, mode, name="layers")
      index = jnp.arange(cfg.num_decoder_layers)
      x, kv = layers(x, segment_ids, positions, cache, cache_mask, cache_positions, index)
    else:
      kvs = []
      for i in range(cfg.num_decoder_layers):
        layer_cache = None if cache is None else jax.tree_util.tree_map(lambda c, i=i: c[i], cache)
        layer = block(cfg, self.mesh, deterministic, mode, name=f"layers_{i}")
        x, layer_kv = layer(x, segment_ids, positions, layer_cache, cache_mask, cache_positions, i)
        kvs.append(layer_kv)
      kv = None if mode == ct.MODEL_MODE_TRAIN else jax.tree_util.tree_map(lambda *a: jnp.stack(a), *kvs)

    x = family.norm(cfg, "decoder_norm")(x)
    if cfg.logits_via_embedding:
      logits = embed.attend(x)
    else:
      logits = DenseGeneral((cfg.vocab_size,), (ct.EMBED, ct.VOCAB), cfg, name="logits_dense")(x)
    logits = soft_cap(logits, cfg.final_logits_soft_cap)
    logits = sharding.constrain(logits, (ct.BATCH, ct.LENGTH, ct.ACT_VOCAB), self.mesh, cfg)
    return logits if mode == ct.MODEL_MODE_TRAIN else (logits, kv)


def init_inputs(batch: int, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Dummy (tokens, segment_ids, positions) of a shape, for init and eval_shape."""
  ids = jnp.zeros((batch, length), jnp.int32)
  return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

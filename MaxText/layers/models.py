"""The decoder-only Transformer: embeddings, a stack of one family's decoder layers (families.py), the output."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import families, sharding
from MaxText.common_types import Config
from MaxText.layers.attentions import soft_cap
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral

_save_only = jax.checkpoint_policies.save_only_these_names

# MaxText's `remat_policy` names: what the backward pass keeps of the forward pass (by the checkpoint_name()s
# in the layers) instead of recomputing it. full keeps nothing; minimal keeps matmul outputs without batch
# dims; save_* keep the named projections; none does not rematerialise at all.
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
  "save_qkv_proj": _save_only("query_proj", "key_proj", "value_proj"),
  "save_dot_except_mlp": _save_only("query_proj", "key_proj", "value_proj", "out_proj"),
  "save_dot_except_mlpwi": _save_only("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
  "save_out_proj": _save_only("out_proj"),
  "none": None,
}


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
    family = families.get(cfg.decoder_block).layer
    embed = Embed(cfg, name="token_embedder")
    x = embed(tokens) if input_embeddings is None else input_embeddings
    if family.scale_embeddings:
      x = x * jnp.asarray(cfg.emb_dim**0.5, x.dtype)
    if cfg.trainable_position_size > 0:
      x = x + Embed(cfg, cfg.trainable_position_size, name="position_embedder")(positions)
    x = sharding.constrain(x, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), self.mesh, cfg)

    block = family
    if cfg.remat_policy != "none" and mode == ct.MODEL_MODE_TRAIN:
      block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
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

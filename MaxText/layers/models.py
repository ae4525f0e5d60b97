"""The decoder-only Transformer: embeddings, the stacks of its decoder_block's layers (decoders.py), the output."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers import context_parallel, decoders, pipeline
from MaxText.layers.attention_masks import soft_cap
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import DenseGeneral
from MaxText.sections import implement
from MaxText.sections import layers as section

_policies = jax.checkpoint_policies
_save_only = _policies.save_only_these_names
_QKV = ("query_proj", "key_proj", "value_proj")

# MaxText's `remat_policy` names: what the backward pass keeps of the forward pass (by the checkpoint_name()s
# in the layers) instead of recomputing it. full keeps nothing; minimal keeps matmul outputs without batch
# dims; minimal_flash also the attention output (`context`); save_* keep the named projections; none does not
# rematerialise at all. The *_offloaded policies keep what save_qkv_proj / minimal keep, in host memory
# (OFFLOADED below) on TPU and GPU; on the CPU device memory is host memory, so they are those policies.
REMAT_POLICIES = implement(
  section.REMAT_POLICIES,
  {
    "full": _policies.nothing_saveable,
    "minimal": _policies.checkpoint_dots_with_no_batch_dims,
    "minimal_flash": _policies.save_from_both_policies(_policies.checkpoint_dots_with_no_batch_dims, _save_only("context")),
    "save_qkv_proj": _save_only(*_QKV),
    "save_dot_except_mlp": _save_only(*_QKV, "out_proj"),
    "save_dot_except_mlpwi": _save_only(*_QKV, "out_proj", "mlpwo"),
    "save_out_proj": _save_only("out_proj"),
    "qkv_proj_offloaded": _save_only(*_QKV),
    "minimal_offloaded": _policies.checkpoint_dots_with_no_batch_dims,
    "none": None,
  },
)
OFFLOADED = {
  "qkv_proj_offloaded": _policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=list(_QKV), offload_src="device", offload_dst="pinned_host"
  ),
  "minimal_offloaded": _policies.offload_dot_with_no_batch_dims(offload_src="device", offload_dst="pinned_host"),
}


def remat_policy(name: str, platform: str):
  """The jax.checkpoint policy of remat_policy=`name` for devices of `platform` (cpu, gpu, tpu)."""
  return OFFLOADED[name] if name in OFFLOADED and platform != "cpu" else REMAT_POLICIES[name]


def output_logits(config: Config, embed: Embed, x: jax.Array) -> jax.Array:
  """The output head: final-norm activations [..., embed] -> soft-capped logits [..., vocab], in float32 when
  logits_dot_in_fp32 (else the activation dtype). Shared by the Transformer and the vocabulary-tiled loss."""
  dtype = jnp.float32 if config.logits_dot_in_fp32 else None
  if config.logits_via_embedding:
    logits = embed.attend(x, dtype)
  else:
    logits = DenseGeneral((config.vocab_size,), (ct.EMBED, ct.VOCAB), config, compute_dtype=dtype, name="logits_dense")(x)
  return soft_cap(logits, config.final_logits_soft_cap)


class OutputHead(nn.Module):
  """output_logits() as a module over the Transformer's own head parameters (`logits_dense`, or
  `token_embedder` when tied), so the loss can apply the head to chunks of activations (num_vocab_tiling)."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return output_logits(self.config, Embed(self.config, name="token_embedder"), x)

  @staticmethod
  def params(params: dict) -> dict:
    """The head's part of the Transformer's params."""
    return {k: params[k] for k in ("logits_dense", "token_embedder") if k in params}


class Transformer(nn.Module):
  """Token ids -> next-token logits.

  tokens, segment_ids, positions: [batch, length] int32 (segment 0 is padding; positions restart per
  document) -> logits [batch, length, vocab] in the activation dtype. `input_embeddings` [batch, length,
  embed], when given, replaces the token lookup (tests take gradients with respect to it). With return_hidden
  the output head is left out: the final-norm activations [batch, length, embed] are returned, for a loss
  that applies OutputHead to chunks of them (num_vocab_tiling).

  Decoding (`model_mode`, see common_types) returns (logits, kv) instead. Prefill: kv = (keys, values)
  of every layer, [layers, batch, length, kv_heads, head_dim] each. Autoregressive: length is 1, `cache`
  is (keys, values) [layers, batch, cache_len, kv_heads, head_dim] with `cache_mask` [batch, cache_len]
  marking each row's filled slots and `cache_positions` [batch, cache_len] their token positions, and kv
  is the new token's (keys, values), [layers, batch, 1, kv_heads, head_dim], for the caller to write into
  the cache. With multi-head latent attention (attention_type=mla) the pair is (latent, k_pe) instead, [...,
  1, kv_lora_rank] and [..., 1, qk_rope_head_dim] (layers/attention_mla.py).
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  model_mode: str = ct.MODEL_MODE_TRAIN

  @nn.compact
  def __call__(  # noqa: PLR0913 (the model's three inputs, then its options and decoding's cache, all by keyword)
    self,
    tokens,
    segment_ids,
    positions,
    *,
    deterministic: bool = True,
    input_embeddings=None,
    cache=None,
    cache_mask=None,
    cache_positions=None,
    return_hidden: bool = False,
  ):
    cfg, mode = self.config, self.model_mode
    family = decoders.layer(cfg.decoder_block)
    # Context parallelism with load balancing: the layers see the tokens in load-balanced order (attention's work
    # even across devices); the activations return to the natural order before the output head.
    balanced = context_parallel.reorders(cfg, self.mesh, mode)
    if balanced:
      # One reorder for the three (stacked): as three, XLA's CPU runtime could start the embedding's all-gather on
      # some devices before the others had finished the last reorder's collective permutes, and hang.
      # (int32: one dtype to stack; ids and positions fit it.)
      ids = (tokens, segment_ids, positions)
      stacked = self._reorder(jnp.stack([a.astype(jnp.int32) for a in ids], axis=-1), (ct.BATCH, ct.LENGTH, None))
      tokens, segment_ids, positions = (stacked[..., i].astype(a.dtype) for i, a in enumerate(ids))
      if input_embeddings is not None:
        input_embeddings = self._reorder(input_embeddings, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED))
    embed = Embed(cfg, name="token_embedder")
    x = embed(tokens) if input_embeddings is None else input_embeddings
    if family.scale_embeddings:
      x = x * jnp.asarray(cfg.emb_dim**0.5, x.dtype)
    if cfg.trainable_position_size > 0:
      x = x + Embed(cfg, cfg.trainable_position_size, name="position_embedder")(positions)
    x = sharding.constrain(x, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), self.mesh, cfg)

    remat = cfg.remat_policy != "none" and mode == ct.MODEL_MODE_TRAIN
    if remat:
      platform = (self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]).platform
      policy = remat_policy(cfg.remat_policy, platform)
    deterministic = deterministic or not cfg.enable_dropout or cfg.dropout_rate == 0.0
    kvs = []
    stacks = decoders.layer_stacks(cfg)
    for stack in stacks:
      block = nn.remat(stack.layer, policy=policy, prevent_cse=not cfg.scan_layers) if remat else stack.layer
      if stack is stacks[-1] and pipeline.runs(cfg, self.mesh, mode) and not self.is_initializing():
        x = self._pipeline(block(cfg, self.mesh, deterministic, mode, parent=None), stack, x, segment_ids, positions)
        continue
      # A stack's steps are layers, or periods of layers (decoders.Stack): its cache [steps, ...], and its steps'
      # indices from `first`.
      stack_cache = (
        None if cache is None else jax.tree_util.tree_map(lambda c, s=stack: s.by_step(c[s.start : s.end]), cache)
      )
      first = stack.start // stack.period
      if cfg.scan_layers:
        scanned = nn.scan(
          block,
          variable_axes={"params": 0, "intermediates": 0},
          split_rngs={"params": True, "dropout": True},
          in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, nn.broadcast, 0),
          length=stack.count,
          metadata_params={nn.PARTITION_NAME: ct.LAYERS},
        )
        layers = scanned(cfg, self.mesh, deterministic, mode, name=stack.name)
        index = jnp.arange(first, first + stack.count)
        x, kv = layers(x, segment_ids, positions, stack_cache, cache_mask, cache_positions, index)
        kvs.append(jax.tree_util.tree_map(stack.by_layer, kv))
      else:
        for j in range(stack.count):
          layer_cache = None if cache is None else jax.tree_util.tree_map(lambda c, j=j: c[j], stack_cache)
          layer = block(cfg, self.mesh, deterministic, mode, name=f"{stack.name}_{j}")
          x, layer_kv = layer(x, segment_ids, positions, layer_cache, cache_mask, cache_positions, first + j)
          kvs.append(None if layer_kv is None else jax.tree_util.tree_map(lambda a, s=stack: s.by_layer(a[None]), layer_kv))
    kv = None if mode == ct.MODEL_MODE_TRAIN else jax.tree_util.tree_map(lambda *a: jnp.concatenate(a), *kvs)

    if balanced:
      x = self._reorder(x, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), inverse=True)
    x = family.norm(cfg, "decoder_norm")(x)
    if return_hidden:
      return x
    logits = output_logits(cfg, embed, x)
    logits = sharding.constrain(logits, (ct.BATCH, ct.LENGTH, ct.ACT_VOCAB), self.mesh, cfg)
    return logits if mode == ct.MODEL_MODE_TRAIN else (logits, kv)

  def _pipeline(self, layer: nn.Module, stack: decoders.Stack, x, segment_ids, positions):
    """The last stack's layers through the pipeline (layers/pipeline.py), on its parameters as they are stored
    (scanned: [layers, ...]; unrolled: one entry per layer, stacked here), sowing what the layers sow where they
    would have."""
    cfg, params = self.config, self.variables["params"]
    if cfg.scan_layers:
      stacked = params[stack.name]
    else:
      names = [f"{stack.name}_{j}" for j in range(stack.count)]
      stacked = jax.tree_util.tree_map(lambda *p: jnp.stack(p), *[params[name] for name in names])
    rng = None if layer.deterministic else self.make_rng("dropout")
    x, sown = pipeline.run(layer, stacked, x, segment_ids, positions, stack.start, rng)
    if sown and cfg.scan_layers:
      pipeline.Sow(name=stack.name)(sown)
    elif sown:
      for j, name in enumerate(names):
        pipeline.Sow(name=name)(jax.tree_util.tree_map(lambda v, j=j: v[j], sown))
    return x

  def _reorder(self, x, logical_axes, inverse=False):
    return context_parallel.reorder(x, logical_axes, self.config, self.mesh, inverse)


def init_inputs(batch: int, length: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Dummy (tokens, segment_ids, positions) of a shape, for init and eval_shape."""
  ids = jnp.zeros((batch, length), jnp.int32)
  return ids, jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))

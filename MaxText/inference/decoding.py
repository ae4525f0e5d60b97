"""KV-cache decoding: prefill a batch of prompts in one forward pass, then generate inside one compiled loop.

Layout. Prompts are right-padded to a bucket length B (a power of two, at most max_prefill_predict_length,
so a new prompt length reuses a compiled prefill). The cache holds max_target_length slots per row: the
prompt fills slots [0, B) (its padding masked out), and generated token i of every row goes to slot B + i,
so all rows write the same slot at each step. Each row has its own positions (its prompt length + i), and
`mask` marks the slots a row may attend to, so a row's result never depends on the other rows or on the
padding. Keys are cached after RoPE.

  prefill(params, tokens, lengths) -> (logits of each row's last prompt token, Cache)
  step(params, cache, tokens)      -> (logits of the next token, Cache with those tokens written)
  generate(params, cache, logits, key) -> (tokens [batch, max_target_length - max_prefill_predict_length],
                                           number of tokens generated)

`generate` samples the first token from the prefill's logits, then runs `step` and sampling in a
`lax.while_loop` until every row has produced EOS or the length is reached: one dispatch for all tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.inference.sampling import Sampling, sample
from MaxText.layers import decoders, models
from MaxText.layers.linears import DTYPES

MIN_BUCKET = 16


@struct.dataclass
class Cache:
  """What a layer caches is its attention's: MLA (attention_type=mla) caches its compressed latent as `keys`,
  [layers, batch, max_target_length, 1, kv_lora_rank], and the shared RoPE key as `values`, [..., 1,
  qk_rope_head_dim] (layers/attention_mla.py); their logical axes are the decoder layer's `kv_cache_axes`."""

  keys: jax.Array  # [layers, batch, max_target_length, kv_heads, head_dim], after RoPE (MLA: [..., 1, kv_lora_rank])
  values: jax.Array  # [layers, batch, max_target_length, kv_heads, head_dim] (MLA: [..., 1, qk_rope_head_dim])
  mask: jax.Array  # [batch, max_target_length] bool: the slots each row attends to
  slot_positions: jax.Array  # [batch, max_target_length] int32: the token position held in each slot
  positions: jax.Array  # [batch] int32: position of each row's next token
  slot: jax.Array  # int32: the slot the next token's keys and values are written to


def cache_kv_axes(config: Config) -> tuple[str | None, ...]:
  """The logical axes of the cache's keys or values: the layers, then what the decoder layer caches per layer."""
  return (ct.LAYERS, *decoders.layer(config.decoder_block).kv_cache_axes)


def check(config: Config) -> None:
  if config.max_prefill_predict_length >= config.max_target_length:
    raise ConfigError(
      f"max_prefill_predict_length={config.max_prefill_predict_length} leaves no room to generate within "
      f"max_target_length={config.max_target_length}; make max_target_length larger"
    )
  if config.max_prefill_predict_length < 1:
    raise ConfigError(f"max_prefill_predict_length={config.max_prefill_predict_length} must be positive")


def buckets(max_prefill: int) -> list[int]:
  """Prefill lengths that get compiled: powers of two from MIN_BUCKET, then max_prefill itself."""
  sizes = [b for b in (2**i for i in range(4, 31)) if b < max_prefill]
  return [*sizes, max_prefill]


def bucket(length: int, max_prefill: int) -> int:
  return next(b for b in buckets(max_prefill) if b >= length)


def pad_prompts(prompts: list[np.ndarray], batch: int, max_prefill: int, pad_id: int = 0):
  """Token lists -> (tokens [batch, B] right-padded, lengths [batch]); rows past the prompts are empty
  (length 0) and generate nothing."""
  if len(prompts) > batch:
    raise ValueError(f"{len(prompts)} prompts do not fit a batch of {batch}")
  longest = max((len(p) for p in prompts), default=1)
  if longest > max_prefill:
    raise ConfigError(
      f"a prompt is {longest} tokens but max_prefill_predict_length={max_prefill}; shorten it or raise "
      "max_prefill_predict_length (and max_target_length with it)"
    )
  width = bucket(max(longest, 1), max_prefill)
  tokens = np.full((batch, width), pad_id, np.int32)
  lengths = np.zeros((batch,), np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, : len(prompt)] = prompt
    lengths[row] = len(prompt)
  return tokens, lengths


@dataclasses.dataclass
class Decoder:
  """Compiled prefill, step and generate for one config and mesh; parameters are passed to each call."""

  config: Config
  mesh: jax.sharding.Mesh
  eos_id: int = -1  # -1: never stop early
  pad_id: int = 0
  num_tokens: int | None = None  # ids >= this are never sampled (a tokenizer smaller than vocab_size)

  def __post_init__(self):
    check(self.config)
    cfg = self.config
    self.sampling = Sampling.from_config(cfg)
    self.num_generated = cfg.max_target_length - cfg.max_prefill_predict_length
    self._prefill_model = models.Transformer(cfg, self.mesh, ct.MODEL_MODE_PREFILL)
    self._step_model = models.Transformer(cfg, self.mesh, ct.MODEL_MODE_AUTOREGRESSIVE)
    kv = sharding.logical_sharding(cache_kv_axes(cfg), self.mesh, cfg)
    rows = sharding.logical_sharding((ct.CACHE_BATCH,), self.mesh, cfg)
    self.cache_shardings = Cache(
      keys=kv,
      values=kv,
      mask=sharding.logical_sharding((ct.CACHE_BATCH, ct.CACHE_SEQUENCE), self.mesh, cfg),
      slot_positions=sharding.logical_sharding((ct.CACHE_BATCH, ct.CACHE_SEQUENCE), self.mesh, cfg),
      positions=rows,
      slot=sharding.logical_sharding((), self.mesh, cfg),
    )
    self.batch_sharding = sharding.logical_sharding((ct.CACHE_BATCH, None), self.mesh, cfg)
    self.prefill = jax.jit(self._prefill, out_shardings=(None, self.cache_shardings))
    self.step = jax.jit(self._step, out_shardings=(None, self.cache_shardings), donate_argnums=(1,))
    self.generate = jax.jit(self._generate)

  def params_dtype(self):
    """The dtype decoding keeps parameters in. On GPU and TPU, the activation dtype when it is narrower than
    weight_dtype: every use casts a parameter to the activation dtype first, so results are the same and
    each step reads half the bytes. On CPU, weight_dtype: XLA hoists the cast out of the generate loop, and
    its bfloat16 dots ran the generate loop faster from float32 storage (docs/PERFORMANCE.md)."""
    dtype, weight = DTYPES[self.config.dtype], DTYPES[self.config.weight_dtype]
    if self.mesh.devices.flat[0].platform == "cpu":
      return weight
    return dtype if jnp.finfo(dtype).bits < jnp.finfo(weight).bits else weight

  # ------------------------------------------------------------------------------------- the functions
  def _prefill(self, params, tokens, lengths):
    cfg = self.config
    batch, width = tokens.shape
    segments = (jnp.arange(width)[None, :] < lengths[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, (keys, values) = self._prefill_model.apply({"params": params}, tokens, segments, positions)
    last = logits[jnp.arange(batch), jnp.maximum(lengths - 1, 0)]

    def place(prompt_kv):  # the prompt's keys or values into slots [0, width) of an empty cache
      layers, _, _, heads, dim = prompt_kv.shape
      empty = jnp.zeros((layers, batch, cfg.max_target_length, heads, dim), prompt_kv.dtype)
      return jax.lax.dynamic_update_slice(empty, prompt_kv, (0, 0, 0, 0, 0))

    mask = jnp.zeros((batch, cfg.max_target_length), bool).at[:, :width].set(segments.astype(bool))
    slot_positions = jnp.zeros((batch, cfg.max_target_length), jnp.int32).at[:, :width].set(positions)
    width = jnp.asarray(width, jnp.int32)
    cache = Cache(place(keys), place(values), mask, slot_positions, lengths.astype(jnp.int32), width)
    return last, cache

  def _step(self, params, cache: Cache, tokens):
    """tokens [batch]: each row's newest token -> its next-token logits [batch, vocab]; writes its keys and
    values into the cache at `cache.slot`."""
    batch = tokens.shape[0]
    ones = jnp.ones((batch, 1), jnp.int32)
    logits, (keys, values) = self._step_model.apply(
      {"params": params},
      tokens[:, None],
      ones,
      cache.positions[:, None],
      cache=(cache.keys, cache.values),
      cache_mask=cache.mask,
      cache_positions=cache.slot_positions,
    )
    at = (0, 0, cache.slot, 0, 0)
    cache = Cache(
      keys=jax.lax.dynamic_update_slice(cache.keys, keys.astype(cache.keys.dtype), at),
      values=jax.lax.dynamic_update_slice(cache.values, values.astype(cache.values.dtype), at),
      mask=jax.lax.dynamic_update_slice(cache.mask, jnp.ones((batch, 1), bool), (0, cache.slot)),
      slot_positions=jax.lax.dynamic_update_slice(cache.slot_positions, cache.positions[:, None], (0, cache.slot)),
      positions=cache.positions + 1,
      slot=cache.slot + 1,
    )
    return logits[:, 0], cache

  def _sample(self, logits, key, i):
    if self.num_tokens is not None and self.num_tokens < logits.shape[-1]:
      logits = jnp.where(jnp.arange(logits.shape[-1]) < self.num_tokens, logits, -jnp.inf)
    return sample(logits, jax.random.fold_in(key, i), self.sampling)

  def _generate(self, params, cache: Cache, logits, key):
    n = self.num_generated
    batch = logits.shape[0]
    first = self._sample(logits, key, 0)
    done = (cache.positions == 0) | (first == self.eos_id)  # empty rows are done from the start
    first = jnp.where(cache.positions == 0, self.pad_id, first)
    out = jnp.full((batch, n), self.pad_id, jnp.int32).at[:, 0].set(first)

    def cond(carry):
      i, _, _, done = carry
      return (i < n) & ~jnp.all(done)

    def body(carry):
      i, cache, out, done = carry
      logits, cache = self._step(params, cache, out[:, i - 1])
      token = self._sample(logits, key, i)
      token = jnp.where(done, self.pad_id, token)
      out = jax.lax.dynamic_update_slice(out, token[:, None], (0, i))
      return i + 1, cache, out, done | (token == self.eos_id)

    count, _, out, _ = jax.lax.while_loop(cond, body, (jnp.asarray(1, jnp.int32), cache, out, done))
    return out, count

  # ------------------------------------------------------------------------------------- host side
  def batch_shards(self) -> int:
    """How many ways the batch is split (the mesh axes of cache_batch): batch sizes must be multiples."""
    axes = self.batch_sharding.spec[0] or ()
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([self.mesh.shape[a] for a in axes], dtype=np.int64))

  def put_batch(self, tokens: np.ndarray, lengths: np.ndarray):
    """Host arrays -> device arrays with the batch sharded as the cache is."""
    return jax.device_put(tokens, self.batch_sharding), jax.device_put(lengths, self.cache_shardings.positions)

  def fetch(self, out: jax.Array, count: jax.Array, rows: int) -> tuple[list[np.ndarray], int]:
    """generate's output on the host of every process (in a multi-process job each process holds only some
    rows: they are gathered): the first `rows` rows, each up to (not including) its first EOS, and the number
    of tokens generated per row (EOS and padding included)."""
    out, count = multihost_utils.process_allgather((out, count), tiled=True)
    return [strip(row, self.eos_id) for row in np.asarray(out)[:rows, : int(count)]], int(count)

  def decode(self, params, prompts: list[np.ndarray], seed: int | None = None) -> list[np.ndarray]:
    """Token lists -> generated token lists (up to and without EOS), one per prompt, batched by the
    configured batch size."""
    cfg = self.config
    key = jax.random.key(cfg.decode_sampling_seed if seed is None else seed)
    batch = cfg.micro_batch_size
    results = []
    for start in range(0, len(prompts), batch):
      chunk = prompts[start : start + batch]
      tokens, lengths = pad_prompts(chunk, batch, cfg.max_prefill_predict_length, self.pad_id)
      logits, cache = self.prefill(params, *self.put_batch(tokens, lengths))
      out, count = self.generate(params, cache, logits, key)
      results.extend(self.fetch(out, count, len(chunk))[0])
    return results


def strip(tokens: np.ndarray, eos_id: int) -> np.ndarray:
  """A row's generated tokens up to (not including) its first EOS."""
  ends = np.flatnonzero(tokens == eos_id)
  return tokens[: ends[0]] if len(ends) else tokens

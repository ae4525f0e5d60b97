"""The inference engine: continuous batching over a fixed number of decode slots, on a paged KV cache.

decode.py, serve.py, evaluation and reinforcement-learning rollouts all generate through it.

A request waits in a queue until a slot is free and the pages its prompt and max_tokens may need are available
(`admit`). Its prompt is then prefilled into its pages: in one call, or with use_chunked_prefill in chunks of
prefill_chunk_size, one chunk per round between the running requests' decode steps, so a long prompt does not
stall them. The first chunk of a prompt runs the model's prefill mode (the training attention kernels); later
chunks, and a prompt whose first pages came from the prefix cache, attend to the cache (`extend`, the same
function a decode step runs with one token per slot). The prefill samples the request's first token; from then
on its slot generates with the others in `generate`, one compiled `lax.while_loop` of up to
decode_steps_per_dispatch steps per call. The loop ends early when a slot finishes while a request waits, so the
slot is refilled at once; the host is not in the loop per token.

While a streamed request runs (Request.stream), a call runs only the steps that fit in stream_interval_ms, as
measured per batch shape (the loop's step limit is a traced argument: no new program), so its client gets its
tokens every few tens of ms instead of in bursts of decode_steps_per_dispatch.

Every request samples with its own settings and its own key (from its seed and the token's index), so its random
draws never depend on its neighbours or its slot. Its arithmetic can: a generate call runs a power of two of the
busy rows and reads the pages the longest reaches, and a matmul's rounding of a row follows the number of rows;
with decode_batch_invariant every call runs all slots over whole rows, so a request's tokens and logprobs are the
same bits whatever its neighbours (for a given number of slots). The cache layout and
the prefix cache are layers/kv_cache.py's and pages.py's. Device state lives in `Slots`; the host keeps one
`_Row` per busy slot (its pages, the tokens so far, its text decoded after the prompt by detokenize.StopText) and
a mirror of `Slots` in numpy.
"""

import collections
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

from MaxText import checkpointing, sharding, state
from MaxText import common_types as ct
from MaxText.common_types import Config, ConfigError
from MaxText.inference import detokenize as detokenize_lib
from MaxText.inference import pages as pages_lib
from MaxText.inference.sampling import Sampling, sample_rows
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import decoders, kv_cache, models, quantizations
from MaxText.layers.linears import DTYPES

MAX_TOP_LOGPROBS = 5  # OpenAI's limit for completions' logprobs
MAX_STOP_IDS = 16  # stop token ids per request, EOS included
MIN_BUCKET = 16
MIN_READ_TOKENS = 64  # the fewest cache positions a generate call reads (see Engine._pages_read)


class RequestError(ValueError):
  """A request the engine cannot run; the message names the field (`max_tokens=...: ...`)."""


class QueueFull(RuntimeError):
  """More requests wait than the queue holds."""


class EngineFailed(RuntimeError):
  """The engine's thread failed; it takes no more requests."""


@dataclasses.dataclass(frozen=True)
class Request:
  prompt: tuple[int, ...]  # token ids, BOS included by the caller when wanted
  max_tokens: int  # tokens to generate at most
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int | None = None  # None: the engine draws one
  stop: tuple[str, ...] = ()  # stop strings: the text is cut before the first one
  stop_token_ids: tuple[int, ...] = ()  # besides EOS, which always stops
  logprobs: int | None = None  # None: none; k: each sampled token's logprob and the k most likely alternatives
  echo: bool = False  # also the prompt tokens' logprobs (with logprobs)
  ignore_eos: bool = False  # generate past EOS (benchmarks: a fixed number of tokens)
  stream: bool = False  # a client reads the tokens as they come: while it runs, generate calls last stream_interval_ms


@dataclasses.dataclass
class TokenLogprob:
  logprob: float  # of the token, under the model's distribution (before temperature, top-k and top-p)
  top: list[tuple[int, float]]  # the k most likely (token, logprob), most likely first


@dataclasses.dataclass
class Update:
  tokens: list[int]  # new tokens since the last update (none past a stop)
  text: str  # new text since the last update, decoded after the prompt (detokenize.py: prompt + text is its tokens')
  logprobs: list[TokenLogprob] | None  # one per new token, when asked for
  prompt_logprobs: list[TokenLogprob | None] | None = None  # first update only, with echo (entry 0 is None)
  finish_reason: str | None = None  # last update only: "stop" (EOS, a stop id or string), "length", "abort"
  stop_token: int | None = None  # last update only: the EOS or stop id that ended it, left out of tokens and text
  stop_logprob: TokenLogprob | None = None  # with logprobs: stop_token's (RL trains on the stop token too)


@dataclasses.dataclass
class Result:
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  logprobs: list[TokenLogprob] | None = None
  prompt_logprobs: list[TokenLogprob | None] | None = None
  finish_reason: str | None = None
  stop_token: int | None = None
  stop_logprob: TokenLogprob | None = None

  def add(self, update: Update) -> None:
    self.tokens += update.tokens
    self.text += update.text
    if update.logprobs is not None:
      self.logprobs = (self.logprobs or []) + update.logprobs
    if update.prompt_logprobs is not None:
      self.prompt_logprobs = update.prompt_logprobs
    self.finish_reason = update.finish_reason or self.finish_reason
    if update.stop_token is not None:
      self.stop_token, self.stop_logprob = update.stop_token, update.stop_logprob


@struct.dataclass
class Slots:
  """The decode slots on the device, one row each ([slots] unless said)."""

  last: jax.Array  # int32: the newest token, the next step's input (its keys are not cached yet)
  lengths: jax.Array  # int32: tokens in the cache, which is also `last`'s position
  active: jax.Array  # bool: generating
  budget: jax.Array  # int32: tokens it may still generate
  counter: jax.Array  # int32: tokens sampled so far (the index its key is folded with)
  seeds: jax.Array  # uint32 [slots, 2]: the request's seed, its low and high 32 bits
  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  stop_ids: jax.Array  # int32 [slots, MAX_STOP_IDS], -1 padded


def _empty_slots(n: int) -> dict[str, np.ndarray]:
  return {
    "last": np.zeros(n, np.int32),
    "lengths": np.zeros(n, np.int32),
    "active": np.zeros(n, bool),
    "budget": np.zeros(n, np.int32),
    "counter": np.zeros(n, np.int32),
    "seeds": np.zeros((n, 2), np.uint32),
    "temperature": np.zeros(n, np.float32),
    "top_k": np.zeros(n, np.int32),
    "top_p": np.ones(n, np.float32),
    "stop_ids": np.full((n, MAX_STOP_IDS), -1, np.int32),
  }


def counted(n: int, noun: str) -> str:
  """A count and its noun, plural unless the count is one ("1 slot", "2 slots"), for what the tools print."""
  return f"{n} {noun}{'' if n == 1 else 's'}"


def bucket(length: int, limit: int) -> int:
  """The padded length of a prefill chunk: a power of two from MIN_BUCKET, or `limit` (so few lengths compile)."""
  size = MIN_BUCKET
  while size < length:
    size *= 2
  return min(size, limit)


def check(config: Config) -> None:
  """The engine's config keys, as one-line errors."""
  if config.max_prefill_predict_length >= config.max_target_length:
    raise ConfigError(
      f"max_prefill_predict_length={config.max_prefill_predict_length} leaves no room to generate within "
      f"max_target_length={config.max_target_length}; make max_target_length larger"
    )
  if config.max_prefill_predict_length < 1:
    raise ConfigError(f"max_prefill_predict_length={config.max_prefill_predict_length} must be positive")
  for key in ("pagedattn_tokens_per_page", "prefill_chunk_size", "decode_steps_per_dispatch"):
    if getattr(config, key) < 1:
      raise ConfigError(f"{key}={getattr(config, key)} must be at least 1")
  if config.decode_batch_invariant and config.enable_prefix_caching:
    raise ConfigError(
      "decode_batch_invariant=true with enable_prefix_caching=true: a prompt whose first pages another request "
      "cached is prefilled by another path (attention to the cache), so its tokens would depend on that request; "
      "drop one of them"
    )
  if config.stream_interval_ms < 0:
    raise ConfigError(f"stream_interval_ms={config.stream_interval_ms} is negative; give 0 (off) or a time in ms, e.g. 20")
  if config.pagedattn_num_pages < 0:
    raise ConfigError(
      f"pagedattn_num_pages={config.pagedattn_num_pages} is negative; give 0 (enough for every slot) or more"
    )
  per_row = math.ceil(config.max_target_length / config.pagedattn_tokens_per_page)
  if 0 < config.pagedattn_num_pages < per_row:
    raise ConfigError(
      f"pagedattn_num_pages={config.pagedattn_num_pages} cannot hold one request of max_target_length="
      f"{config.max_target_length} ({per_row} pages of {config.pagedattn_tokens_per_page}); give at least {per_row}"
    )


def params_dtype(config: Config, mesh: jax.sharding.Mesh):
  """The dtype decoding keeps parameters in. On GPU and TPU, the activation dtype when it is narrower than
  weight_dtype: every use casts a parameter to the activation dtype first, so results are the same and each step
  reads half the bytes. On CPU, weight_dtype: XLA hoists the cast out of the generate loop, and its bfloat16 dots
  ran the generate loop faster from float32 storage (docs/changelog.md)."""
  dtype, weight = DTYPES[config.dtype], DTYPES[config.weight_dtype]
  if mesh.devices.flat[0].platform == "cpu":
    return weight
  return dtype if jnp.finfo(dtype).bits < jnp.finfo(weight).bits else weight


def serving_params(config: Config, mesh: jax.sharding.Mesh, params):
  """`params` as the engine's models read them: with int8w / int4w, float ones quantized once, on the devices
  into the weight-only layout (state.params_layout of the quantized model), and quantized ones (loaded with
  checkpoint_is_quantized) as they are; without weight-only quantization, `params` themselves.

  On CPU int4 values are kept widened to int8 (the same integers): jax 0.10's CPU arrays of int4 carry another
  memory layout than its compiled programs ask for, so the engine's executables (donating the KV pool) refuse them."""
  if params is None or not quantizations.is_weight_only(config):
    return params
  if not quantizations.is_quantized(params):
    model = quantizations.quantize_model(models.Transformer(config, mesh), config)
    abstract, shardings = state.params_layout(model, config, mesh)
    params = quantizations.quantize_on_mesh(params, abstract, shardings, config)
  return quantizations.widened(params) if mesh.devices.flat[0].platform == "cpu" else params


def _keys(seeds: jax.Array) -> jax.Array:
  """seeds [rows, 2] uint32 (a 64-bit seed's low and high halves) -> typed PRNG keys [rows]."""
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s[0]), s[1]))(seeds)


def _fetch(tree):
  """Device arrays -> numpy on every process (gathered across processes in a multi-process job)."""
  if jax.process_count() > 1:
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.tree_util.tree_map(np.asarray, tree)


def _top(logprobs: jax.Array, tokens: jax.Array):
  """logprobs [..., vocab] -> (logprob of `tokens` [...], top ids [..., MAX_TOP_LOGPROBS], their logprobs)."""
  picked = jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]
  top_lp, top_ids = jax.lax.top_k(logprobs, MAX_TOP_LOGPROBS)
  return picked, top_ids.astype(jnp.int32), top_lp


@dataclasses.dataclass(frozen=True)
class Program:
  """One executable warmup compiles: prefill of a chunk width, or generate of a number of rows and of pages."""

  name: str  # "prefill" or "generate"
  shape: tuple[int, int]  # prefill: (chunk width, 1 for a first chunk else 0); generate: (rows, pages read)

  def __str__(self) -> str:
    if self.name == "prefill":
      return f"prefill of {counted(self.shape[0], 'token')}{'' if self.shape[1] else ' (a later chunk)'}"
    return f"generate, {counted(self.shape[0], 'row')} reading {counted(self.shape[1], 'page')}"


class Engine:
  """Compiled prefill and generate for one config, mesh and set of parameters, and the scheduler over them."""

  def __init__(  # noqa: PLR0913 (the model's three, then keyword-only options)
    self,
    config: Config,
    mesh: jax.sharding.Mesh,
    params,
    *,
    eos_id: int = -1,
    pad_id: int = 0,
    num_tokens: int | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
    max_queue: int = 64,
    steps_per_dispatch: int | None = None,
    num_slots: int | None = None,
    sampled_logprobs: bool = False,
    stream_interval_ms: float | None = None,
  ):
    check(config)
    quantizations.check_devices(config, mesh.devices.flat[0])  # as training's: fp8 on a GPU without it, megablox
    cfg = self.config = config
    self.mesh = mesh
    self.params = serving_params(cfg, mesh, params)
    self.eos_id, self.pad_id, self.num_tokens = eos_id, pad_id, num_tokens
    self.detokenize = detokenize
    self.max_queue = max_queue
    self.num_slots = num_slots or cfg.micro_batch_size  # RL rollouts: every completion of a step at once
    # Logprobs of the distribution each token was drawn from, the logits over the request's temperature (RL's
    # importance ratio; top-k and top-p left out, as TRL leaves them); by default the model's own (OpenAI's).
    self.sampled_logprobs = sampled_logprobs
    self.steps = steps_per_dispatch or cfg.decode_steps_per_dispatch
    # While a streaming request runs, a generate call runs as many steps as fit in this time (at least one), so
    # its client gets tokens this often; the other calls run self.steps (the host is out of the loop for longer).
    interval = cfg.stream_interval_ms if stream_interval_ms is None else stream_interval_ms
    self.stream_interval = interval / 1e3
    self._step_seconds = {}  # (rows, pages) of a generate call -> seconds per step, as measured (moving average)
    self._last_call_seconds = 0.0
    self.max_prompt_length = cfg.max_prefill_predict_length
    self.max_length = cfg.max_target_length
    self.page_size = cfg.pagedattn_tokens_per_page
    self.pages_per_row = math.ceil(cfg.max_target_length / self.page_size)
    num_pages = cfg.pagedattn_num_pages or self.num_slots * self.pages_per_row
    self.pages = pages_lib.Pages(num_pages, self.page_size)
    self._num_pages = num_pages
    self._zeros = None
    self.chunk = cfg.prefill_chunk_size if cfg.use_chunked_prefill else self.max_prompt_length
    self.default_sampling = Sampling.from_config(cfg)
    # With `quantization`, qwix's model: int8w / int4w read quantized weights, int8 / fp8 / fp8_full quantize the
    # float ones in each matmul as training does (the same numerics as the train step's forward pass).
    self._prefill_model = quantizations.quantize_model(models.Transformer(cfg, mesh, ct.MODEL_MODE_PREFILL), cfg)
    self._step_model = quantizations.quantize_model(models.Transformer(cfg, mesh, ct.MODEL_MODE_AUTOREGRESSIVE), cfg)
    self.pool = self._empty_pool(num_pages)
    batch = sharding.logical_sharding((ct.CACHE_BATCH,), mesh, cfg).spec
    split = batch[0] if batch else None
    split = () if split is None else (split,) if isinstance(split, str) else split
    self._batch_shards = int(np.prod([mesh.shape[a] for a in split], dtype=np.int64))
    self._executables = {}
    self.stats = collections.Counter()  # seconds and counts: prefill, generate, compile, steps, tokens
    # The host's side: the slots' requests, their page tables, the queue.
    self._rows: list[_Row | None] = [None] * self.num_slots
    self._host = _empty_slots(self.num_slots)
    self._table = np.zeros((self.num_slots, self.pages_per_row), np.int32)
    self._waiting = collections.deque()
    self._cancelled = set()
    self._next_id = 0
    self._lock = threading.Condition()
    self._thread = None
    self._stopping = False
    self.failure = None  # what ended the engine's thread, when it failed

  @classmethod
  def from_config(cls, config: Config, **options) -> tuple["Engine", object]:
    """(engine, tokenizer) for `config` as decode.py and serve.py load them: the tokenizer of tokenizer_path, the
    mesh of the config, the parameters of load_parameters_path (else the run's latest checkpoint)."""
    check(config)
    if not config.tokenizer_path:
      raise ConfigError(
        "decoding needs tokenizer_path=PATH and tokenizer_type= (the tokenizer the checkpoint was trained with)"
      )
    tokenizer = tokenizer_lib.check_tokenizer(config)
    mesh = sharding.create_mesh(config)
    params, where = checkpointing.load_params(config, mesh, params_dtype(config, mesh))
    logging.info("Parameters from %s", where)
    options = {
      "eos_id": tokenizer.eos_id,
      "pad_id": max(tokenizer.pad_id, 0),
      "num_tokens": tokenizer.vocab_size,
      "detokenize": tokenizer.decode,
      **options,
    }
    engine = cls(config, mesh, params, **options)
    engine.loaded_from = where
    return engine, tokenizer

  # --------------------------------------------------------------------------------- device functions
  def _pool_axes(self) -> tuple:
    """The pool's logical axes: the layers, then pages and their tokens (not split), then what a layer caches
    per token (its kv_cache_axes after batch and sequence: heads split as the contiguous cache's are)."""
    per_token = decoders.layer(self.config.decoder_block).kv_cache_axes[2:]
    return (ct.LAYERS, None, None, *per_token)

  def _empty_pool(self, num_pages: int):
    """A pool of zeros; its program is compiled once (load() allocates the pool again after each release())."""
    if self._zeros is None:
      # What a prefill writes of one token, as the pool stores it (kv_cache.stored: int8 and scales, quantized).
      shapes = jax.eval_shape(
        lambda p: kv_cache.stored(
          self._prefill_model.apply({"params": p}, *(jnp.zeros((1, 1), jnp.int32),) * 3)[1], self.config
        ),
        self.params,
      )
      self._pool_sharding = kv_cache.shardings(
        shapes, self._pool_axes(), lambda axes: sharding.logical_sharding(axes, self.mesh, self.config)
      )

      def zeros():
        return jax.tree_util.tree_map(
          lambda s: jnp.zeros((s.shape[0], num_pages, self.page_size, *s.shape[3:]), s.dtype), shapes
        )

      self._zeros = jax.jit(zeros, out_shardings=self._pool_sharding)
    return self._zeros()

  def _write(self, pool, new, table, positions, valid):
    """new (keys, values) [layers, batch, t, ...] of the tokens at `positions` [batch, t] into their pages;
    tokens not `valid` are dropped (padding, idle slots). With quantize_kvcache they are quantized here."""
    new = kv_cache.stored(new, self.config)
    page = jnp.take_along_axis(table, positions // self.page_size, axis=1)
    page = jnp.where(valid, page, self.pages.num_pages)  # out of range: dropped
    offset = positions % self.page_size
    return jax.tree_util.tree_map(lambda p, n: p.at[:, page, offset].set(n.astype(p.dtype), mode="drop"), pool, new)

  def _mask(self, logits):
    if self.num_tokens is not None and self.num_tokens < logits.shape[-1]:
      logits = jnp.where(jnp.arange(logits.shape[-1]) < self.num_tokens, logits, -jnp.inf)
    return logits.astype(jnp.float32)

  def _sampled(self, logprobs, temperature):
    """logprobs [rows, vocab] as the logprobs reports: the model's, or with sampled_logprobs those of the
    distribution sampled from (log_softmax(logits / temperature); greedy rows keep the model's)."""
    if not self.sampled_logprobs:
      return logprobs
    return jax.nn.log_softmax(logprobs / jnp.where(temperature > 0, temperature, 1.0)[:, None], axis=-1)

  def _extend(self, params, pool, table, tokens, positions, valid):
    """tokens [batch, t] at `positions`, after the positions[:, 0] tokens each row's pages hold -> (logits
    [batch, t, vocab], the pool with their keys and values written)."""
    slots = table.shape[1] * self.page_size
    batch = tokens.shape[0]
    held = positions[:, :1]
    cache_positions = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
    layers = jax.tree_util.tree_leaves(pool)[0].shape[0]
    paged = kv_cache.Paged(*pool, jnp.broadcast_to(table, (layers, *table.shape)))
    logits, new = self._step_model.apply(
      {"params": params},
      tokens,
      jnp.ones_like(tokens),
      positions,
      cache=paged,
      cache_mask=cache_positions < held,
      cache_positions=cache_positions,
    )
    return logits, self._write(pool, new, table, positions, valid)

  def _prefill(self, params, pool, table, chunk, sampling, *, first: bool, echo: bool):
    """One chunk of one prompt: `chunk` holds tokens [1, C] at positions start + [0, C), of which the first
    `count` are real, and `targets` [1, C], the prompt's tokens after them (for echo).
    Returns the pool, the token sampled after the chunk's last real token, (its logprob, top ids, top
    logprobs), and with echo each position's logprob of its target and its top."""
    tokens, start, count = chunk["tokens"], chunk["start"], chunk["count"]
    width = tokens.shape[1]
    positions = start + jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = jnp.arange(width)[None, :] < count
    if first:  # nothing cached before it: the prefill mode's kernels
      segments = valid.astype(jnp.int32)
      logits, new = self._prefill_model.apply({"params": params}, tokens, segments, positions)
      pool = self._write(pool, new, table, positions, valid)
    else:
      logits, pool = self._extend(params, pool, table, tokens, positions, valid)
    logprobs = jax.nn.log_softmax(self._mask(logits), axis=-1)
    last = logprobs[:, count - 1]
    keys = jax.vmap(jax.random.fold_in)(_keys(sampling["seeds"]), jnp.zeros((1,), jnp.int32))
    token = sample_rows(last, keys, sampling["temperature"], sampling["top_k"], sampling["top_p"])
    picked = _top(self._sampled(last, sampling["temperature"]), token)
    prompt = _top(logprobs, chunk["targets"]) if echo else None
    return pool, token, picked, prompt

  def _generate(self, params, pool, table, slots: Slots, refill, limit, *, logprobs: bool):
    """Up to `limit` (at most `self.steps`, a traced int32: a shorter call compiles nothing new) decode steps of
    every active slot -> (pool, slots, tokens [slots, steps], (logprobs, top ids, top logprobs) of each when
    asked, steps run). Stops when no slot is active, or when a slot finished and `refill` says a request waits
    for it."""
    n, k = slots.last.shape[0], self.steps
    out = {"tokens": jnp.full((n, k), self.pad_id, jnp.int32)}
    if logprobs:
      out |= {
        "logprob": jnp.zeros((n, k), jnp.float32),
        "top_ids": jnp.zeros((n, k, MAX_TOP_LOGPROBS), jnp.int32),
        "top_logprobs": jnp.zeros((n, k, MAX_TOP_LOGPROBS), jnp.float32),
      }

    def cond(carry):
      i, _, slots, _, finished = carry
      return (i < jnp.minimum(limit, k)) & jnp.any(slots.active) & ~(refill & finished)

    def body(carry):
      i, pool, s, out, finished = carry
      logits, pool = self._extend(params, pool, table, s.last[:, None], s.lengths[:, None], s.active[:, None])
      logits = self._mask(logits[:, 0])
      keys = jax.vmap(jax.random.fold_in)(_keys(s.seeds), s.counter)
      token = sample_rows(logits, keys, s.temperature, s.top_k, s.top_p)
      token = jnp.where(s.active, token, self.pad_id)
      stop = s.active & (jnp.any(token[:, None] == s.stop_ids, axis=-1) | (s.budget <= 1))
      columns = {"tokens": token}
      if logprobs:
        picked, top_ids, top_lp = _top(self._sampled(jax.nn.log_softmax(logits, axis=-1), s.temperature), token)
        columns |= {"logprob": picked, "top_ids": top_ids, "top_logprobs": top_lp}
      out = {name: out[name].at[:, i].set(columns[name]) for name in out}
      step = s.active.astype(jnp.int32)
      s = s.replace(
        last=jnp.where(s.active, token, s.last),
        lengths=s.lengths + step,
        budget=s.budget - step,
        counter=s.counter + step,
        active=s.active & ~stop,
      )
      return i + 1, pool, s, out, finished | jnp.any(stop)

    init = (jnp.asarray(0, jnp.int32), pool, slots, out, jnp.asarray(False))
    count, pool, slots, out, _ = jax.lax.while_loop(cond, body, init)
    return pool, slots, out, count

  def _compiled(self, name: str, fn, *args, **static):
    """fn's executable for these argument shapes, compiled on first use ("compile_seconds" counts it)."""
    key = (name, tuple(sorted(static.items())), tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args[1:])))
    executable = self._executables.get(key)
    if executable is None:
      start = time.perf_counter()
      out_shardings = (self._pool_sharding, None, None, None)
      jitted = jax.jit(functools.partial(fn, **static), donate_argnums=(1,), out_shardings=out_shardings)
      executable = self._executables[key] = jitted.lower(*args).compile()
      self.stats["compile_seconds"] += time.perf_counter() - start
    return executable

  def _call(self, name: str, fn, *args, **static):
    """fn(*args) through its compiled executable; stats[name + "_seconds"] counts the runs."""
    executable = self._compiled(name, fn, *args, **static)
    start = time.perf_counter()
    out = jax.block_until_ready(executable(*args))
    self._last_call_seconds = time.perf_counter() - start
    self.stats[f"{name}_seconds"] += self._last_call_seconds
    return out

  def programs(self) -> list[Program]:
    """Every program serving may run (without logprobs), as warmup compiles them: each prefill chunk width (and
    with chunked prefill or the prefix cache, each for a later chunk), each number of generate rows by each number
    of pages they read."""
    widths = sorted({bucket(n, self.chunk) for n in range(1, self.chunk + 1)})
    later = self.config.use_chunked_prefill or self.config.enable_prefix_caching
    out = [Program("prefill", (w, int(first))) for w in widths for first in ((1, 0) if later else (1,))]
    pages = sorted({self._pages_read(n * self.page_size) for n in range(1, self.pages_per_row + 1)})
    rows = sorted({self._rows_bucket(n) for n in range(1, self.num_slots + 1)})
    return out + [Program("generate", (r, p)) for r in rows for p in pages]

  def warmup(self, progress: Callable[[int, Program], None] | None = None) -> None:
    """Compiles every program of `programs()`, so that no request waits for a compile (serve.py calls it before it
    listens); `progress(i, program)` is called after the i-th (from 1) is compiled."""
    chunk = {"start": np.int32(0), "count": np.int32(1)}
    sampling = {k: v[:1] for k, v in _empty_slots(1).items() if k in ("seeds", "temperature", "top_k", "top_p")}
    for i, program in enumerate(self.programs(), 1):
      if program.name == "prefill":
        width, first = program.shape
        tokens = np.zeros((1, width), np.int32)
        args = (self.params, self.pool, self._table[:1], {**chunk, "tokens": tokens, "targets": tokens}, sampling)
        self._compiled("prefill", self._prefill, *args, first=bool(first), echo=False)
      else:
        rows, pages = program.shape
        slots = Slots(**{name: value[:rows] for name, value in self._host.items()})
        args = (self.params, self.pool, self._table[:rows, :pages], slots, np.bool_(False), np.int32(self.steps))
        self._compiled("generate", self._generate, *args, logprobs=False)
      if progress is not None:
        progress(i, program)

  def load(self, params) -> None:
    """New parameters for the idle engine (RL's rollouts, between updates). Every cached prefix is dropped, since
    its keys and values came from the old ones, and the KV pool is allocated again if `release` freed it."""
    if self.busy():
      raise RuntimeError("load() swaps the parameters of an idle engine; requests are running")
    self.params = serving_params(self.config, self.mesh, params)
    self.pages = pages_lib.Pages(self._num_pages, self.page_size)
    if self.pool is None:
      self.pool = self._empty_pool(self._num_pages)

  def release(self) -> None:
    """Drops the parameters and the KV pool of the idle engine, so their memory is free until `load` (RL's train
    step runs between rollouts; it donates the parameters the engine would otherwise still hold)."""
    if self.busy():
      raise RuntimeError("release() frees an idle engine; requests are running")
    self.params = self.pool = None

  # --------------------------------------------------------------------------------- requests
  def check(self, request: Request) -> None:
    """Raises RequestError naming the field when the engine cannot run `request`."""
    n = len(request.prompt)
    if n == 0:
      raise RequestError("prompt: the prompt is empty; give at least one token")
    if n > self.max_prompt_length:
      raise RequestError(
        f"prompt: {n} tokens, more than the longest prompt, {self.max_prompt_length} (max_prefill_predict_length)"
      )
    if request.max_tokens < 1:
      raise RequestError(f"max_tokens={request.max_tokens}: must be at least 1")
    if n + request.max_tokens > self.max_length:
      raise RequestError(
        f"max_tokens={request.max_tokens}: the prompt's {n} tokens and max_tokens exceed the cache's "
        f"{self.max_length} tokens (max_target_length); ask for at most {self.max_length - n}"
      )
    vocab = min(self.num_tokens or self.config.vocab_size, self.config.vocab_size)
    if any(not 0 <= t < vocab for t in request.prompt):
      raise RequestError(f"prompt: token ids must be in [0, {vocab})")
    if request.seed is not None and not 0 <= request.seed < 2**64:
      raise RequestError(f"seed={request.seed}: must be in [0, 2**64)")
    if request.temperature < 0:
      raise RequestError(f"temperature={request.temperature}: must be >= 0")
    if request.top_k < 0:
      raise RequestError(f"top_k={request.top_k}: must be >= 0 (0 is off)")
    if not 0 < request.top_p <= 1:
      raise RequestError(f"top_p={request.top_p}: must be in (0, 1]")
    if len(set(request.stop_token_ids) | {self.eos_id}) > MAX_STOP_IDS:
      raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS - 1} ids")
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
      raise RequestError(f"logprobs={request.logprobs}: must be in [0, {MAX_TOP_LOGPROBS}]")
    if request.echo and request.logprobs is None:
      raise RequestError("echo: the prompt's logprobs need logprobs set")
    if request.stop and self.detokenize is None:
      raise RequestError("stop: stop strings need a tokenizer")

  def submit(self, request: Request, on_update: Callable[[Update], None]) -> int:
    """Queues `request`; `on_update` gets its updates on the engine's thread. Returns its id."""
    self.check(request)
    if self.failure is not None:
      raise EngineFailed(f"the engine failed ({self.failure}); restart the server")
    with self._lock:
      if len(self._waiting) >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests wait already (the queue holds {self.max_queue})")
      request_id = self._next_id
      self._next_id += 1
      self._waiting.append(_Row(request_id, request, on_update))
      self._lock.notify()
    return request_id

  def cancel(self, request_id: int) -> None:
    with self._lock:
      self._cancelled.add(request_id)
      self._lock.notify()

  def generate(self, requests: list[Request]) -> list[Result]:
    """Runs `requests` to completion in the caller's thread (the engine must not be started)."""
    if self._thread is not None:
      raise RuntimeError("generate() runs the engine itself; it is started in a thread already")
    for request in requests:  # every request checked before any is queued
      self.check(request)
    results = [Result() for _ in requests]
    for request, result in zip(requests, results, strict=True):
      self._waiting.append(_Row(self._next_id, request, result.add))
      self._next_id += 1
    while self.busy():
      self.run_once()
    return results

  def busy(self) -> bool:
    return bool(self._waiting) or any(row is not None for row in self._rows)

  def start(self) -> None:
    """Runs the scheduler in a daemon thread until stop()."""
    self._stopping = False
    self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    with self._lock:
      self._stopping = True
      self._lock.notify()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    for slot, row in enumerate(self._rows):
      if row is not None:
        self._free(slot, "abort")
    for row in self._waiting:
      row.finish("abort")
    self._waiting.clear()

  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _serve(self) -> None:
    while True:
      with self._lock:
        while not self._stopping and not self.busy() and not self._cancelled:
          self._lock.wait()
        if self._stopping:
          return
      try:
        self.run_once()
      except Exception as e:  # Ends every request instead of hanging its client; the engine (its pool possibly
        # donated to the call that failed) takes no more.
        logging.exception("the engine failed; its requests are aborted")
        self.failure = f"{type(e).__name__}: {e}"
        with self._lock:
          waiting, self._waiting = list(self._waiting), collections.deque()
        for slot, row in enumerate(self._rows):
          if row is not None:
            self._free(slot, "abort")
        for row in waiting:
          row.finish("abort")
        return

  # --------------------------------------------------------------------------------- scheduling
  def run_once(self) -> None:
    """One round: cancellations, admissions, one prefill chunk per prefilling slot, then one generate call."""
    with self._lock:
      cancelled, self._cancelled = self._cancelled, set()
      self._waiting = collections.deque(r for r in self._waiting if r.id not in cancelled)
    for slot, row in enumerate(self._rows):
      if row is not None and row.id in cancelled:
        self._free(slot, None)
    self._admit()
    for slot, row in enumerate(self._rows):
      if row is not None and row.prefilled < len(row.request.prompt):
        self._prefill_chunk(slot, row)
    if self._host["active"].any():
      self._decode()

  def _pages_needed(self, tokens: int) -> int:
    return math.ceil(tokens / self.page_size)

  def _pages_read(self, tokens: int) -> int:
    """Pages a generate call reads to reach `tokens` positions: a power of two of them covering at least
    MIN_READ_TOKENS (fewer shapes to compile; short caches are read whole), at most a row's; with
    decode_batch_invariant always a row's (the attention's reductions then never depend on the longest neighbour)."""
    if self.config.decode_batch_invariant:
      return self.pages_per_row
    floor = self._pages_needed(MIN_READ_TOKENS)
    return _power_of_two(max(self._pages_needed(tokens), floor), self.pages_per_row)

  def _reserved(self) -> int:
    """Pages the busy slots may still take (each up to its prompt and max_tokens)."""
    return sum(row.reserve - len(row.pages) for row in self._rows if row is not None)

  def _admit(self) -> None:
    for slot in range(self.num_slots):
      if self._rows[slot] is not None:
        continue
      with self._lock:
        if not self._waiting:
          return
        row = self._waiting[0]
      request = row.request
      prompt = request.prompt
      # Cached pages for the prompt's full pages but its last token (whose logits the prefill must compute);
      # not with echo, which needs every prompt token's logprobs.
      digests = pages_lib.prefix_digests(prompt, self.page_size)
      shared = []
      if self.config.enable_prefix_caching and not request.echo:
        shared = self.pages.match(digests[: (len(prompt) - 1) // self.page_size])
      row.reserve = self._pages_needed(len(prompt) + request.max_tokens - 1)
      if self.pages.available() - self._reserved() < row.reserve - len(shared):
        self.pages.release(shared)
        return  # Waits for pages (first come, first served).
      with self._lock:
        self._waiting.popleft()
      row.digests, row.pages = digests, list(shared)
      row.prefilled = len(shared) * self.page_size
      self.stats["prefix_hit_tokens"] += row.prefilled
      self._take_pages(slot, row, len(prompt))
      self._rows[slot] = row

  def _take_pages(self, slot: int, row: "_Row", tokens: int) -> None:
    """Gives the row pages for its first `tokens` tokens (at most its reserve)."""
    while len(row.pages) < min(self._pages_needed(tokens), row.reserve):
      row.pages.append(self.pages.take())
    self._table[slot, : len(row.pages)] = row.pages

  def _sampling(self, request: Request, seed: int) -> dict[str, np.ndarray]:
    return {
      "seeds": np.asarray([[seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]], np.uint32),
      "temperature": np.asarray([request.temperature], np.float32),
      "top_k": np.asarray([request.top_k], np.int32),
      "top_p": np.asarray([request.top_p], np.float32),
    }

  def _prefill_chunk(self, slot: int, row: "_Row") -> None:
    prompt = row.request.prompt
    start = row.prefilled
    count = min(self.chunk, len(prompt) - start)
    width = bucket(count, self.chunk)
    tokens = np.full((1, width), self.pad_id, np.int32)
    tokens[0, :count] = prompt[start : start + count]
    targets = np.zeros((1, width), np.int32)
    following = prompt[start + 1 : start + count + 1]
    targets[0, : len(following)] = following
    if row.seed is None:
      row.seed = row.request.seed if row.request.seed is not None else int(np.random.randint(0, 2**31 - 1))
    echo = row.request.echo
    self.pool, token, picked, prompt_lp = self._call(
      "prefill",
      self._prefill,
      self.params,
      self.pool,
      self._table[slot : slot + 1],
      {"tokens": tokens, "start": np.int32(start), "count": np.int32(count), "targets": targets},
      self._sampling(row.request, row.seed),
      first=start == 0,
      echo=echo,
    )
    token, picked, prompt_lp = _fetch((token, picked, prompt_lp))
    self.stats["prefill_tokens"] += count
    if echo:
      k = row.request.logprobs
      picked_lp, top_ids, top_lp = (a[0, :count] for a in prompt_lp)
      row.prompt_logprobs += [
        TokenLogprob(float(lp), _pairs(ids, lps, k)) for lp, ids, lps in zip(picked_lp, top_ids, top_lp, strict=True)
      ]
    row.prefilled += count
    if row.prefilled < len(prompt):
      return
    for page, digest in zip(row.pages, row.digests, strict=False):
      self.pages.cache(page, digest)
    if row.prompt_logprobs is not None:
      row.prompt_logprobs = [None, *row.prompt_logprobs[: len(prompt) - 1]]
    self._start_decoding(slot, row, int(token[0]), (float(picked[0][0]), picked[1][0], picked[2][0]))

  def _start_decoding(self, slot: int, row: "_Row", token: int, logprob) -> None:
    request, host = row.request, self._host
    stop_ids = sorted({*request.stop_token_ids, *(() if request.ignore_eos else (self.eos_id,))} - {-1})
    host["stop_ids"][slot] = -1
    host["stop_ids"][slot, : len(stop_ids)] = stop_ids
    sampling = self._sampling(request, row.seed)
    for name in ("seeds", "temperature", "top_k", "top_p"):
      host[name][slot] = sampling[name][0]
    host["last"][slot] = token
    host["lengths"][slot] = len(request.prompt)
    host["budget"][slot] = request.max_tokens - 1
    host["counter"][slot] = 1
    stopped = token in stop_ids or request.max_tokens == 1
    host["active"][slot] = not stopped
    self._emit(slot, row, [token], [logprob])

  def _steps_now(self, active: list[int], shape: tuple[int, int]) -> int:
    """Steps for the next generate call: self.steps, or while a streaming request runs as many as its measured
    step time fits in stream_interval (one until that shape has been timed). From this process's clock: streaming
    is serve.py's, which runs in one process (a multi-process job's calls must agree, and never stream)."""
    if self.stream_interval <= 0 or not any(self._rows[slot].request.stream for slot in active):
      return self.steps
    per_step = self._step_seconds.get(shape)
    if per_step is None:
      return 1
    return max(1, min(self.steps, int(self.stream_interval / per_step)))

  def _rows_bucket(self, busy: int) -> int:
    """How many slot rows a generate call runs for `busy` active ones: a power of two (so few sizes compile),
    a multiple of the ways the batch is split, at most every slot. Idle slots cost nothing this way.

    With decode_batch_invariant, every slot: XLA's CPU matmuls (at least) round a row's result differently for
    different numbers of rows (a float32 [1, K] @ [K, N] differs from the same row in an [8, K] one), never for its
    place among a fixed number of them or for the other rows' values, so a fixed number of rows makes a request's
    tokens independent of its neighbours (engine_test checks it, bit for bit)."""
    if self.config.decode_batch_invariant:
      return self.num_slots
    size = _power_of_two(busy, self.num_slots)
    shards = self._batch_shards
    return min(-(-size // shards) * shards, self.num_slots)

  def _decode(self) -> None:
    host = self._host
    active = [slot for slot in range(self.num_slots) if host["active"][slot]]
    idle = [slot for slot in range(self.num_slots) if not host["active"][slot]]
    rows = np.asarray(active + idle[: self._rows_bucket(len(active)) - len(active)])
    # Attention reads only the pages the longest row may reach in this call (a power of two of them).
    pages = self._pages_read(max(int(host["lengths"][slot]) for slot in active) + self.steps)
    steps = self._steps_now(active, (len(rows), pages))
    for slot in active:
      self._take_pages(slot, self._rows[slot], int(host["lengths"][slot]) + steps)
    with self._lock:
      refill = bool(self._waiting)
    logprobs = any(self._rows[slot].request.logprobs is not None for slot in active)
    slots = Slots(**{name: value[rows] for name, value in host.items()})
    table = self._table[rows, :pages]
    self.pool, slots, out, count = self._call(
      "generate", self._generate, self.params, self.pool, table, slots, np.bool_(refill), np.int32(steps),
      logprobs=logprobs,
    )  # fmt: skip
    if int(count):
      seconds = self._last_call_seconds / int(count)
      previous = self._step_seconds.get((len(rows), pages), seconds)
      self._step_seconds[(len(rows), pages)] = 0.5 * previous + 0.5 * seconds
    slots, out, count = _fetch((slots, out, count))
    self.stats["steps"] += int(count)
    before = host["counter"][rows]
    for name, value in host.items():
      value[rows] = getattr(slots, name)
    for j, slot in enumerate(rows[: len(active)]):
      made = int(host["counter"][slot] - before[j])
      self.stats["tokens"] += made
      lps = None
      if logprobs:
        lps = [(float(out["logprob"][j, i]), out["top_ids"][j, i], out["top_logprobs"][j, i]) for i in range(made)]
      self._emit(int(slot), self._rows[slot], [int(t) for t in out["tokens"][j, :made]], lps)

  def _emit(self, slot: int, row: "_Row", tokens: list[int], logprobs) -> None:
    """Sends a slot's new tokens (the stop token left out) and frees the slot when it finished."""
    request = row.request
    active = bool(self._host["active"][slot])
    finish = None
    if not active:
      stopped = tokens and tokens[-1] in self._host["stop_ids"][slot]
      finish = "stop" if stopped else "length"
      if stopped:
        row.stop_token = tokens[-1]
        if request.logprobs is not None and logprobs is not None:
          lp, ids, lps = logprobs[-1]
          row.stop_logprob = TokenLogprob(lp, _pairs(ids, lps, request.logprobs))
        tokens, logprobs = tokens[:-1], (logprobs[:-1] if logprobs is not None else None)
    row.tokens += tokens
    if request.logprobs is not None and logprobs is not None:
      row.pending_logprobs += [TokenLogprob(lp, _pairs(ids, lps, request.logprobs)) for lp, ids, lps in logprobs]
    text, cut = row.new_text(self.detokenize, tokens, final=finish is not None)
    if cut:  # a stop string ended it earlier than any stop token
      finish, row.stop_token, row.stop_logprob = "stop", None, None
    if finish is not None:
      self._free(slot, finish, text)
    else:
      row.send(text, None)

  def _free(self, slot: int, finish: str | None, text: str = "") -> None:
    row = self._rows[slot]
    self._rows[slot] = None
    self._host["active"][slot] = False
    self.pages.release(row.pages)
    self._table[slot] = 0
    if finish is not None:
      row.send(text, finish)


def _power_of_two(n: int, limit: int) -> int:
  """The smallest power of two >= n, at most `limit`."""
  size = 1
  while size < n:
    size *= 2
  return min(size, limit)


def _pairs(ids, logprobs, k: int = MAX_TOP_LOGPROBS) -> list[tuple[int, float]]:
  return [(int(i), float(lp)) for i, lp in zip(ids[:k], logprobs[:k], strict=True)]


@dataclasses.dataclass(eq=False)
class _Row:
  """A request on the host: its pages, the tokens and text it has produced, and what is not sent yet."""

  id: int
  request: Request
  on_update: Callable[[Update], None]
  seed: int | None = None
  pages: list[int] = dataclasses.field(default_factory=list)
  digests: list[bytes] = dataclasses.field(default_factory=list)
  reserve: int = 0
  prefilled: int = 0
  tokens: list[int] = dataclasses.field(default_factory=list)
  sent_tokens: int = 0
  text: detokenize_lib.StopText | None = None  # its text so far, decoded after the prompt (with a detokenizer)
  pending_logprobs: list = dataclasses.field(default_factory=list)
  prompt_logprobs: list | None = None
  first: bool = True
  stop_token: int | None = None  # the EOS or stop id that ended it
  stop_logprob: TokenLogprob | None = None

  def __post_init__(self):
    if self.request.echo:
      self.prompt_logprobs = []

  def new_text(self, detokenize, tokens: list[int], final: bool) -> tuple[str, bool]:
    """(the text `tokens` add that may be sent now, whether a stop string ended it). Until the request ends, text
    that may still turn into a stop string, and an incomplete character at the end, are held back. At a stop
    string, the tokens after the one that completes it are dropped, with their logprobs."""
    if detokenize is None:
      return "", False
    if self.text is None:
      self.text = detokenize_lib.StopText(detokenize, self.request.prompt, self.request.stop)
    text, keep = self.text.add(tokens, final)
    if keep is None:
      return text, False
    drop = len(tokens) - keep
    if drop:
      del self.tokens[len(self.tokens) - drop :]
      del self.pending_logprobs[max(len(self.pending_logprobs) - drop, 0) :]
    return text, True

  def send(self, text: str, finish: str | None) -> None:
    tokens = self.tokens[self.sent_tokens :]
    self.sent_tokens = len(self.tokens)
    logprobs = None
    if self.request.logprobs is not None:
      logprobs, self.pending_logprobs = self.pending_logprobs, []
    update = Update(tokens, text, logprobs, self.prompt_logprobs if self.first else None, finish)
    if finish is not None:
      update.stop_token, update.stop_logprob = self.stop_token, self.stop_logprob
    self.first = False
    self.on_update(update)

  def finish(self, reason: str) -> None:
    self.send("", reason)

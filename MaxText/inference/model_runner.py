"""The model runner: the compiled programs that run the model on the paged KV cache, and the slots' device state.

Three programs, each compiled once per shape (`Program`) and kept: the prefill of one chunk of one prompt (the
first chunk runs the model's prefill mode, the training attention kernels; a later chunk, or one after cached
pages, attends to the cache: `extend`), and `generate`, one `lax.while_loop` of up to decode_steps_per_dispatch
decode steps of every active slot, which ends early when a slot finishes while a request waits (its slot is then
refilled at once). A prefill chunk is padded to a power of two of tokens (`bucket`); a generate call runs a power of
two of the busy rows (`rows_bucket`) and reads the pages the longest reaches (kv_cache_manager.pages_read), so few
shapes compile; warmup compiles them all.

The runner also holds the parameters (`load` / `release`, for RL between its updates), the KV pool (layers/kv_cache.py
stores it), and the slots' sampling state (`Slots` on the device, mirrored in numpy in `host`). Every request
samples with its own settings and its own key (from its seed and the token's index), so its random draws never
depend on its neighbours or its slot. Its arithmetic can: a matmul's rounding of a row follows the number of rows;
with decode_batch_invariant every call runs all slots over whole rows, so a request's tokens and logprobs are the
same bits whatever its neighbours (for a given number of slots).
"""

import collections
import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from MaxText import common_types as ct
from MaxText import sharding, state
from MaxText.common_types import Config
from MaxText.inference.kv_cache_manager import power_of_two
from MaxText.inference.request import MAX_TOP_LOGPROBS, Request, counted
from MaxText.inference.sampling import sample_rows
from MaxText.inference.slots import SAMPLING, Slots, empty_slots, sampling_of
from MaxText.layers import decoders, kv_cache, models, quantizations
from MaxText.layers.linears import DTYPES

MIN_BUCKET = 16


def bucket(length: int, limit: int) -> int:
  """The padded length of a prefill chunk: a power of two from MIN_BUCKET, or `limit` (so few lengths compile)."""
  size = MIN_BUCKET
  while size < length:
    size *= 2
  return min(size, limit)


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


@dataclasses.dataclass
class Prefilled:
  """What a prefill chunk gives back (numpy): the token sampled after its last real token, that token's (logprob,
  top ids, top logprobs), and with echo each position's (logprob of the prompt's next token, top ids, top logprobs)."""

  token: int
  logprob: tuple
  prompt: tuple | None


class ModelRunner:
  """The compiled prefill and generate programs of one config, mesh and set of parameters, and the slots' state."""

  def __init__(  # noqa: PLR0913 (the model's three, then the cache's shape and the engine's options)
    self,
    config: Config,
    mesh: jax.sharding.Mesh,
    params,
    *,
    num_slots: int,
    num_pages: int,
    pages_per_row: int,
    pages_read: Callable[[int], int],
    steps: int,
    pad_id: int = 0,
    num_tokens: int | None = None,
    sampled_logprobs: bool = False,
    stats: collections.Counter | None = None,
  ):
    cfg = self.config = config
    self.mesh = mesh
    self.params = serving_params(cfg, mesh, params)
    self.num_slots, self.num_pages, self.pages_per_row = num_slots, num_pages, pages_per_row
    self.page_size = cfg.pagedattn_tokens_per_page
    self.pages_read = pages_read
    self.steps = steps
    self.pad_id, self.num_tokens = pad_id, num_tokens
    # Logprobs of the distribution each token was drawn from, the logits over the request's temperature (RL's
    # importance ratio; top-k and top-p left out, as TRL leaves them); by default the model's own (OpenAI's).
    self.sampled_logprobs = sampled_logprobs
    self.stats = collections.Counter() if stats is None else stats  # prefill, generate, compile seconds; steps
    self.chunk = cfg.prefill_chunk_size if cfg.use_chunked_prefill else cfg.max_prefill_predict_length
    self.step_seconds = {}  # (rows, pages) of a generate call -> seconds per step, as measured (moving average)
    self._last_call_seconds = 0.0
    self._zeros = None
    # With `quantization`, qwix's model: int8w / int4w read quantized weights, int8 / fp8 / fp8_full quantize the
    # float ones in each matmul as training does (the same numerics as the train step's forward pass).
    self._prefill_model = quantizations.quantize_model(models.Transformer(cfg, mesh, ct.MODEL_MODE_PREFILL), cfg)
    self._step_model = quantizations.quantize_model(models.Transformer(cfg, mesh, ct.MODEL_MODE_AUTOREGRESSIVE), cfg)
    self.pool = self._empty_pool(num_pages)
    batch = sharding.logical_sharding((ct.CACHE_BATCH,), mesh, cfg).spec
    split = batch[0] if batch else None
    split = () if split is None else (split,) if isinstance(split, str) else split
    self._batch_shards = int(np.prod([mesh.shape[a] for a in split], dtype=np.int64))
    self.executables = {}
    self.host = empty_slots(num_slots)  # the slots' state as the next generate call takes it

  # --------------------------------------------------------------------------------- the slots, on the host
  def start(self, slot: int, request: Request, seed: int, token: int, stop_ids: list[int]) -> bool:
    """The slot generates `request` from its prefilled prompt and first token; False when that token ended it."""
    host = self.host
    host["stop_ids"][slot] = -1
    host["stop_ids"][slot, : len(stop_ids)] = stop_ids
    sampling = sampling_of(request, seed)
    for name in SAMPLING:
      host[name][slot] = sampling[name][0]
    host["last"][slot] = token
    host["lengths"][slot] = len(request.prompt)
    host["budget"][slot] = request.max_tokens - 1
    host["counter"][slot] = 1
    host["active"][slot] = not (token in stop_ids or request.max_tokens == 1)
    return bool(host["active"][slot])

  def active(self) -> list[int]:
    return [slot for slot in range(self.num_slots) if self.host["active"][slot]]

  def stop(self, slot: int) -> None:
    self.host["active"][slot] = False

  def rows_bucket(self, busy: int) -> int:
    """How many slot rows a generate call runs for `busy` active ones: a power of two (so few sizes compile),
    a multiple of the ways the batch is split, at most every slot. Idle slots cost nothing this way.

    With decode_batch_invariant, every slot: XLA's CPU matmuls (at least) round a row's result differently for
    different numbers of rows (a float32 [1, K] @ [K, N] differs from the same row in an [8, K] one), never for its
    place among a fixed number of them or for the other rows' values, so a fixed number of rows makes a request's
    tokens independent of its neighbours (engine_test checks it, bit for bit)."""
    if self.config.decode_batch_invariant:
      return self.num_slots
    size = power_of_two(busy, self.num_slots)
    shards = self._batch_shards
    return min(-(-size // shards) * shards, self.num_slots)

  # --------------------------------------------------------------------------------- running the programs
  def prefill(self, table, request: Request, seed: int, start: int, count: int) -> Prefilled:
    """Prefills `count` tokens of the request's prompt from `start` into the pages of `table` [1, pages]."""
    prompt, echo = request.prompt, request.echo
    width = bucket(count, self.chunk)
    tokens = np.full((1, width), self.pad_id, np.int32)
    tokens[0, :count] = prompt[start : start + count]
    targets = np.zeros((1, width), np.int32)
    following = prompt[start + 1 : start + count + 1]
    targets[0, : len(following)] = following
    chunk = {"tokens": tokens, "start": np.int32(start), "count": np.int32(count), "targets": targets}
    self.pool, token, picked, prompt_lp = self._call(
      "prefill", self._prefill, self.params, self.pool, table, chunk, sampling_of(request, seed), first=start == 0,
      echo=echo,
    )  # fmt: skip
    token, picked, prompt_lp = _fetch((token, picked, prompt_lp))
    self.stats["prefill_tokens"] += count
    prompt_out = tuple(a[0, :count] for a in prompt_lp) if echo else None
    return Prefilled(int(token[0]), (float(picked[0][0]), picked[1][0], picked[2][0]), prompt_out)

  def generate(self, active: list[int], table, pages: int, refill: bool, steps: int, logprobs: bool) -> list[tuple]:
    """One generate call of the `active` slots, reading `pages` of each row of `table` [slots, pages per row], for at
    most `steps` steps. Returns (slot, new tokens, their (logprob, top ids, top logprobs) or None) per active slot."""
    host = self.host
    idle = [slot for slot in range(self.num_slots) if not host["active"][slot]]
    rows = np.asarray(active + idle[: self.rows_bucket(len(active)) - len(active)])
    slots = Slots(**{name: value[rows] for name, value in host.items()})
    self.pool, slots, out, count = self._call(
      "generate", self._generate, self.params, self.pool, table[rows, :pages], slots, np.bool_(refill),
      np.int32(steps), logprobs=logprobs,
    )  # fmt: skip
    if int(count):
      seconds = self._last_call_seconds / int(count)
      previous = self.step_seconds.get((len(rows), pages), seconds)
      self.step_seconds[(len(rows), pages)] = 0.5 * previous + 0.5 * seconds
    slots, out, count = _fetch((slots, out, count))
    self.stats["steps"] += int(count)
    before = host["counter"][rows]
    for name, value in host.items():
      value[rows] = getattr(slots, name)
    made = []
    for j, slot in enumerate(rows[: len(active)]):
      n = int(host["counter"][slot] - before[j])
      lps = None
      if logprobs:
        lps = [(float(out["logprob"][j, i]), out["top_ids"][j, i], out["top_logprobs"][j, i]) for i in range(n)]
      made.append((int(slot), [int(t) for t in out["tokens"][j, :n]], lps))
    return made

  # --------------------------------------------------------------------------------- the programs
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
    page = jnp.where(valid, page, self.num_pages)  # out of range: dropped
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
    executable = self.executables.get(key)
    if executable is None:
      start = time.perf_counter()
      out_shardings = (self._pool_sharding, None, None, None)
      jitted = jax.jit(functools.partial(fn, **static), donate_argnums=(1,), out_shardings=out_shardings)
      executable = self.executables[key] = jitted.lower(*args).compile()
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
    pages = sorted({self.pages_read(n * self.page_size) for n in range(1, self.pages_per_row + 1)})
    rows = sorted({self.rows_bucket(n) for n in range(1, self.num_slots + 1)})
    return out + [Program("generate", (r, p)) for r in rows for p in pages]

  def warmup(self, progress: Callable[[int, Program], None] | None = None) -> None:
    """Compiles every program of `programs()`, so that no request waits for a compile (the server calls it before it
    listens); `progress(i, program)` is called after the i-th (from 1) is compiled."""
    chunk = {"start": np.int32(0), "count": np.int32(1)}
    sampling = {k: v[:1] for k, v in empty_slots(1).items() if k in SAMPLING}
    table = np.zeros((self.num_slots, self.pages_per_row), np.int32)  # shapes only: compiling reads no values
    for i, program in enumerate(self.programs(), 1):
      if program.name == "prefill":
        width, first = program.shape
        tokens = np.zeros((1, width), np.int32)
        args = (self.params, self.pool, table[:1], {**chunk, "tokens": tokens, "targets": tokens}, sampling)
        self._compiled("prefill", self._prefill, *args, first=bool(first), echo=False)
      else:
        rows, pages = program.shape
        slots = Slots(**{name: value[:rows] for name, value in self.host.items()})
        args = (self.params, self.pool, table[:rows, :pages], slots, np.bool_(False), np.int32(self.steps))
        self._compiled("generate", self._generate, *args, logprobs=False)
      if progress is not None:
        progress(i, program)

  def load(self, params) -> None:
    """New parameters (RL's rollouts, between updates); the KV pool is allocated again if `release` freed it."""
    self.params = serving_params(self.config, self.mesh, params)
    if self.pool is None:
      self.pool = self._empty_pool(self.num_pages)

  def release(self) -> None:
    """Drops the parameters and the KV pool, so their memory is free until `load` (RL's train step runs between
    rollouts; it donates the parameters the engine would otherwise still hold)."""
    self.params = self.pool = None

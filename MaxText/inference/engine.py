"""The inference engine: continuous batching over a fixed number of decode slots, on a paged KV cache.

decode.py, the server (MaxText/server/), evaluation and reinforcement-learning rollouts all generate through it.
`Engine` is thin: it ties four parts, each in its own module, the way vLLM's v1 engine splits them:

- scheduler.py: the queue, the slots and the policies (first come, first served admission; no preemption, since
  every admitted request holds the pages it may need; how many steps a call runs while a client streams);
- kv_cache_manager.py (over pages.py): each slot's pages and reservation, and the prefix cache;
- model_runner.py (with slots.py): the compiled prefill and generate programs, their shapes, warmup, the
  parameters (load / release) and the slots' device state;
- output.py (with detokenize.py): tokens -> Updates, the text decoded incrementally in linear time, stop strings,
  the texts of logprobs.

A round (`run_once`): cancellations, then admissions, then one prefill chunk per prefilling slot (in one call, or
with use_chunked_prefill in chunks of prefill_chunk_size, one chunk per round between the running requests' decode
steps, so a long prompt does not stall them), then one generate call of the active slots. The prefill samples the
request's first token; from then on its slot generates with the others, one compiled loop of up to
decode_steps_per_dispatch steps per call, the host out of the loop per token. A thread runs rounds while there is
work (`start` / `stop`), or `generate` runs them in the caller's thread.

Request, Update, Result and the errors are request.py's, re-exported here for callers.
"""

import collections
import logging
import math
import threading
from collections.abc import Callable, Sequence

import jax
import numpy as np

from MaxText import checkpointing, sharding
from MaxText.common_types import Config, ConfigError
from MaxText.inference import kv_cache_manager as kv_lib
from MaxText.inference import model_runner as runner_lib
from MaxText.inference.model_runner import Program, bucket, params_dtype, serving_params
from MaxText.inference.output import RequestOutput
from MaxText.inference.request import (
  MAX_STOP_IDS,
  MAX_TOP_LOGPROBS,
  EngineFailed,
  QueueFull,
  Request,
  RequestError,
  Result,
  TokenLogprob,
  Update,
  counted,
)
from MaxText.inference.sampling import Sampling
from MaxText.inference.scheduler import Entry, Scheduler
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import quantizations

__all__ = [  # what callers import from here (the names of request.py and model_runner.py they use)
  "MAX_STOP_IDS",
  "MAX_TOP_LOGPROBS",
  "ConfigError",
  "Engine",
  "EngineFailed",
  "Program",
  "QueueFull",
  "Request",
  "RequestError",
  "Result",
  "TokenLogprob",
  "Update",
  "bucket",
  "check",
  "counted",
  "params_dtype",
  "serving_params",
]


def check(config: Config) -> None:
  """What a program that decodes needs of the config, as one-line errors: room to generate after the longest prompt,
  and a page pool that holds a request (the engine's own keys' ranges are its section's, sections/decoding.py,
  checked when the config is read)."""
  if config.max_prefill_predict_length >= config.max_target_length:
    raise ConfigError(
      f"max_prefill_predict_length={config.max_prefill_predict_length} leaves no room to generate within "
      f"max_target_length={config.max_target_length}; make max_target_length larger"
    )
  if config.max_prefill_predict_length < 1:
    raise ConfigError(f"max_prefill_predict_length={config.max_prefill_predict_length} must be positive")
  per_row = math.ceil(config.max_target_length / config.pagedattn_tokens_per_page)
  if 0 < config.pagedattn_num_pages < per_row:
    raise ConfigError(
      f"pagedattn_num_pages={config.pagedattn_num_pages} cannot hold one request of max_target_length="
      f"{config.max_target_length} ({per_row} pages of {config.pagedattn_tokens_per_page}); give at least {per_row}"
    )


class Engine:
  """The scheduler, the KV cache manager, the model runner and the output processor of one config, mesh and set
  of parameters, tied together."""

  def __init__(  # noqa: PLR0913 (the model's three, then keyword-only options)
    self,
    config: Config,
    mesh: jax.sharding.Mesh,
    params,
    *,
    end_ids: Sequence[int] = (),
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
    self.end_ids = tuple(sorted(set(end_ids) - {-1}))  # a completion ends at any (the tokenizer's end_ids)
    self.num_tokens = num_tokens
    self.detokenize = detokenize
    self.max_queue = max_queue
    self.num_slots = num_slots or cfg.micro_batch_size  # RL rollouts: every completion of a step at once
    # While a streaming request runs, a generate call runs as many steps as fit in this time (at least one), so
    # its client gets tokens this often; the other calls run decode_steps_per_dispatch (the host is out for longer).
    interval = cfg.stream_interval_ms if stream_interval_ms is None else stream_interval_ms
    self.stream_interval = interval / 1e3
    self.max_prompt_length = cfg.max_prefill_predict_length
    self.max_length = cfg.max_target_length
    self.default_sampling = Sampling.from_config(cfg)
    self.stats = collections.Counter()  # seconds and counts: prefill, generate, compile, steps, tokens, prefix hits
    page_size = cfg.pagedattn_tokens_per_page
    num_pages = cfg.pagedattn_num_pages or self.num_slots * math.ceil(cfg.max_target_length / page_size)
    self.kv = kv_lib.KVCacheManager(
      self.num_slots, num_pages, page_size, cfg.max_target_length, cfg.enable_prefix_caching, cfg.decode_batch_invariant
    )
    self.runner = runner_lib.ModelRunner(
      cfg,
      mesh,
      params,
      num_slots=self.num_slots,
      num_pages=num_pages,
      pages_per_row=self.kv.pages_per_row,
      pages_read=self.kv.pages_read,
      steps=steps_per_dispatch or cfg.decode_steps_per_dispatch,
      pad_id=pad_id,
      num_tokens=num_tokens,
      sampled_logprobs=sampled_logprobs,
      stats=self.stats,
    )
    self.scheduler = Scheduler(self.num_slots, max_queue)
    self._thread = None
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
    print(f"decoding {tokenizer.describe_end()}", flush=True)
    options = {
      "end_ids": tokenizer.end_ids,
      "pad_id": max(tokenizer.pad_id, 0),
      "num_tokens": tokenizer.vocab_size,
      "detokenize": tokenizer.decode,
      **options,
    }
    engine = cls(config, mesh, params, **options)
    engine.loaded_from = where
    return engine, tokenizer

  # --------------------------------------------------------------------------------- the parts' state, as before
  @property
  def params(self):
    return self.runner.params

  @property
  def pool(self):
    return self.runner.pool

  @property
  def pages(self):
    return self.kv.pages

  @property
  def pages_per_row(self) -> int:
    return self.kv.pages_per_row

  @property
  def steps(self) -> int:
    return self.runner.steps

  def programs(self) -> list[Program]:
    """Every program serving may run (model_runner.ModelRunner.programs)."""
    return self.runner.programs()

  def warmup(self, progress: Callable[[int, Program], None] | None = None) -> None:
    """Compiles every program of `programs()`, so that no request waits for a compile (the server calls it before
    it listens); `progress(i, program)` is called after the i-th (from 1) is compiled."""
    self.runner.warmup(progress)

  def load(self, params) -> None:
    """New parameters for the idle engine (RL's rollouts, between updates). Every cached prefix is dropped, since
    its keys and values came from the old ones, and the KV pool is allocated again if `release` freed it."""
    if self.busy():
      raise RuntimeError("load() swaps the parameters of an idle engine; requests are running")
    self.kv.reset()
    self.runner.load(params)

  def release(self) -> None:
    """Drops the parameters and the KV pool of the idle engine, so their memory is free until `load` (RL's train
    step runs between rollouts; it donates the parameters the engine would otherwise still hold)."""
    if self.busy():
      raise RuntimeError("release() frees an idle engine; requests are running")
    self.runner.release()

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
    if len(set(request.stop_token_ids) | set(self.end_ids)) > MAX_STOP_IDS:
      raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS - len(self.end_ids)} ids")
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
    return self.scheduler.add(request, RequestOutput(request, on_update, self.detokenize))

  def cancel(self, request_id: int) -> None:
    self.scheduler.cancel(request_id)

  def generate(self, requests: list[Request]) -> list[Result]:
    """Runs `requests` to completion in the caller's thread (the engine must not be started)."""
    if self._thread is not None:
      raise RuntimeError("generate() runs the engine itself; it is started in a thread already")
    for request in requests:  # every request checked before any is queued
      self.check(request)
    results = [Result() for _ in requests]
    for request, result in zip(requests, results, strict=True):
      self.scheduler.add(request, RequestOutput(request, result.add, self.detokenize), bounded=False)
    while self.busy():
      self.run_once()
    return results

  def busy(self) -> bool:
    return self.scheduler.busy()

  def start(self) -> None:
    """Runs the scheduler in a daemon thread until stop()."""
    self.scheduler.set_stopping(False)
    self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    self.scheduler.set_stopping(True)
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self._abort_all()

  def running(self) -> bool:
    return self._thread is not None and self._thread.is_alive()

  def _serve(self) -> None:
    while self.scheduler.wait_for_work():
      try:
        self.run_once()
      except Exception as e:  # Ends every request instead of hanging its client; the engine (its pool possibly
        # donated to the call that failed) takes no more.
        logging.exception("the engine failed; its requests are aborted")
        self.failure = f"{type(e).__name__}: {e}"
        self._abort_all()
        return

  def _abort_all(self) -> None:
    waiting = self.scheduler.drain()
    for slot, entry in enumerate(self.scheduler.slots):
      if entry is not None:
        self._free(slot, "abort")
    for entry in waiting:
      entry.output.finish("abort")

  # --------------------------------------------------------------------------------- a round
  def run_once(self) -> None:
    """One round: cancellations, admissions, one prefill chunk per prefilling slot, then one generate call."""
    for slot in self.scheduler.take_cancelled():
      self._free(slot, None)
    self.scheduler.admit(self._reserve)
    for slot, entry in self.scheduler.prefilling():
      self._prefill_chunk(slot, entry)
    if self.runner.active():
      self._decode()

  def _reserve(self, slot: int, entry: Entry) -> bool:
    """The scheduler's admission test: the KV cache manager reserves the request's pages, if it can."""
    request = entry.request
    cached = self.kv.admit(slot, request.prompt, request.max_tokens, request.echo)
    if cached is None:
      return False
    entry.prefilled = cached
    self.stats["prefix_hit_tokens"] += cached
    return True

  def _prefill_chunk(self, slot: int, entry: Entry) -> None:
    request = entry.request
    start = entry.prefilled
    count = min(self.runner.chunk, len(request.prompt) - start)
    if entry.seed is None:
      entry.seed = request.seed if request.seed is not None else int(np.random.randint(0, 2**31 - 1))
    out = self.runner.prefill(self.kv.table[slot : slot + 1], request, entry.seed, start, count)
    if out.prompt is not None:
      entry.output.add_prompt_logprobs(*out.prompt)
    entry.prefilled += count
    if entry.prefilled < len(request.prompt):
      return
    self.kv.cache_prompt(slot)
    entry.output.prompt_done()
    stop_ids = sorted({*request.stop_token_ids, *(() if request.ignore_eos else self.end_ids)} - {-1})
    running = self.runner.start(slot, request, entry.seed, out.token, stop_ids)
    self._emit(slot, [out.token], [out.logprob], done=not running)

  def _decode(self) -> None:
    active = self.runner.active()
    lengths = self.runner.host["lengths"]
    # Attention reads only the pages the longest row may reach in this call (a power of two of them).
    pages = self.kv.pages_read(max(int(lengths[slot]) for slot in active) + self.runner.steps)
    per_step = self.runner.step_seconds.get((self.runner.rows_bucket(len(active)), pages))
    steps = self.scheduler.steps_now(active, self.runner.steps, per_step, self.stream_interval)
    for slot in active:
      self.kv.grow(slot, int(lengths[slot]) + steps)
    refill = self.scheduler.has_waiting()
    logprobs = any(self.scheduler.slots[slot].request.logprobs is not None for slot in active)
    for slot, tokens, lps in self.runner.generate(active, self.kv.table, pages, refill, steps, logprobs):
      self.stats["tokens"] += len(tokens)
      self._emit(slot, tokens, lps, done=not self.runner.host["active"][slot])

  def _emit(self, slot: int, tokens: list[int], logprobs, done: bool) -> None:
    """Sends a slot's new tokens through its output (the stop token left out); frees the slot when it finished."""
    output = self.scheduler.slots[slot].output
    text, finish = output.process(tokens, logprobs, done, self.runner.host["stop_ids"][slot])
    if finish is not None:
      self._free(slot, finish, text)
    else:
      output.send(text, None)

  def _free(self, slot: int, finish: str | None, text: str = "") -> None:
    entry = self.scheduler.release(slot)
    self.runner.stop(slot)
    self.kv.free(slot)
    if finish is not None:
      entry.output.send(text, finish)

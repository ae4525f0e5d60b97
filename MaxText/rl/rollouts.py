"""Rollouts: each RL step's prompts -> num_generations completions each -> rewards -> the train step's batch.

The completions come from the inference engine (inference/engine.py) in this process, on the training parameters as
they are on the devices: no host copy, cast to the dtype decoding keeps (engine.params_dtype) only where it differs
(and a circular pipeline's layers put back in their natural order, which decoding reads).
Each completion samples with its own seed, a function of (decode_sampling_seed, step, row), so a step's rollouts
depend only on the parameters and the step: a resumed run regenerates them bit for bit.

Prompts are the records of the training split (train_data_columns: one column, "prompt" or "question", a string or a
list of turns, or "messages", a conversation whose trailing assistant turns are left out), shuffled with
data_shuffle_seed, their position saved in each checkpoint; with use_chat_template they are rendered with the
generation prompt, else as [BOS] text. Every process reads the same prompts and runs the same requests (the engine
is SPMD), and every process holds the whole batch, from which each takes its shards.

A step's batch (rows = global_batch_size = prompts x num_generations, row r holding generation r % G of prompt r // G):
the input_pipeline.BATCH_KEYS of prompt and completion (the stop token included: the policy learns to stop), the loss
on completion targets only, plus ROLLOUT_KEYS ("advantages", "old_logprobs"), [rows, max_target_length] float32.
"""

import dataclasses
import json
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from MaxText import chat_template as template_lib
from MaxText import input_pipeline, sharding
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError, shown
from MaxText.inference import engine as engine_lib
from MaxText.inference import prompts as prompts_lib
from MaxText.inference.sampling import Sampling
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.rl import rewards as rewards_lib

PROMPT_COLUMNS = ("prompt", "question", "messages")
ROLLOUT_KEYS = ("advantages", "old_logprobs")  # a batch's float32 entries, beside input_pipeline.BATCH_KEYS


# ---------------------------------------------------------------------------------------------- prompts
def _record(record) -> dict:
  """A record's columns, bytes decoded (ArrayRecord records are UTF-8 JSON; TFDS gives bytes)."""
  from MaxText.input_pipeline import sft

  if isinstance(record, bytes):
    try:
      record = json.loads(record)
    except (ValueError, RecursionError):
      raise ConfigError("train_data_columns: a record is not a JSON object; write each record as UTF-8 JSON") from None
  if not isinstance(record, dict):
    raise ConfigError(f"train_data_columns: a record is a {type(record).__name__}, not an object of columns")
  return {k: sft.decoded(v) for k, v in record.items()}


@dataclasses.dataclass
class Prompt:
  """A record -> {"tokens": its prompt's token ids, "prompt": the prompt column's value, "columns": the record}."""

  config: Config
  tokenizer: tokenizer_lib.Tokenizer
  key: str  # train_data_columns or eval_data_columns, for errors

  def __call__(self, record) -> dict:
    columns = _record(record)
    (column,) = getattr(self.config, self.key)
    if column not in columns:
      raise ConfigError(
        f"{self.key}=[{column!r}]: a record has no column {column!r} (it has {sorted(columns)}); set {self.key}"
      )
    value = columns[column]
    if column == "messages" and isinstance(value, list):
      end = len(value)
      while end and isinstance(value[end - 1], dict) and value[end - 1].get("role") == "assistant":
        end -= 1
      value = value[:end]
    return {"tokens": np.asarray(self.tokens(value, column), np.int32), "prompt": value, "columns": columns}

  def tokens(self, value, column: str) -> list[int]:

    if isinstance(value, str):
      return prompts_lib.prompt_tokens(self.config, self.tokenizer, [value])[0]
    if not (isinstance(value, list) and all(isinstance(turn, dict) for turn in value)):
      raise ConfigError(
        f"{self.key}=[{column!r}]: a record's {column!r} is {_kind(value)}; expected a string, or a list of "
        "{'role', 'content'} turns (or a 'messages' column) with use_chat_template=true"
      )
    if not self.config.use_chat_template:
      raise ConfigError(
        f"{self.key}=[{column!r}]: a record's {column!r} holds turns, which need a chat template; set use_chat_template=true"
      )
    turns = template_lib.check_turns(value, self.key, need_assistant=False)
    if not turns:
      raise ConfigError(f"{self.key}: a conversation has no turn before its assistant turns; give a prompt")
    return prompts_lib.chat_tokens(self.config, self.tokenizer, turns)


def _kind(value) -> str:
  """What a prompt column's value is, for an error: its type and value, for a list the types of its items."""
  if value is None:
    return "null (None)"
  if isinstance(value, list):
    inner = sorted({type(item).__name__ for item in value})
    return f"a list of {', '.join(inner)} {shown(value, 80)}"
  return f"{type(value).__name__} {shown(value, 80)}"


def check_columns(config: Config, key: str) -> None:
  columns = list(getattr(config, key))
  if len(columns) != 1 or columns[0] not in PROMPT_COLUMNS:
    raise ConfigError(
      f"{key}={columns}: RL reads one prompt column; give one of {[[c] for c in PROMPT_COLUMNS]} (the other columns "
      "of a record go to the reward functions)"
    )


class Prompts:
  """A split's prompts, in order (training: shuffled, num_epoch passes), with a position to save and restore."""

  def __init__(self, config: Config, tokenizer: tokenizer_lib.Tokenizer, split: str):
    import grain  # Lazy, as the text pipelines.

    train = split == "train"
    key = "train_data_columns" if train else "eval_data_columns"
    check_columns(config, key)
    self.limit = config.max_prefill_predict_length
    self.dropped = 0
    dataset = grain.MapDataset.source(input_pipeline.records(config, split))
    if train:
      dataset = dataset.shuffle(seed=config.data_shuffle_seed)
    epochs = config.num_epoch if train else (1 if config.eval_steps < 0 else -1)
    dataset = dataset.repeat(None if epochs < 0 else epochs).map(Prompt(config, tokenizer, key))
    self.iterator = iter(dataset.to_iter_dataset())
    self.where = input_pipeline.describe(config, train)

  def take(self, n: int) -> list[dict]:
    """The next n prompts that fit max_prefill_predict_length (longer ones are skipped, and counted); fewer at the
    end of the data."""
    out = []
    skipped = 0
    for example in self.iterator:
      if len(example["tokens"]) > self.limit or len(example["tokens"]) == 0:
        self.dropped += 1
        skipped += 1
        if skipped > 1000 and not out:
          raise ConfigError(
            f"{self.where}: 1000 prompts in a row are longer than max_prefill_predict_length={self.limit} tokens; "
            "raise max_prefill_predict_length (and max_target_length)"
          )
        continue
      out.append(example)
      if len(out) == n:
        break
    return out

  def get_state(self) -> dict:
    return self.iterator.get_state()

  def set_state(self, state: dict | bytes) -> None:
    self.iterator.set_state(json.loads(state) if isinstance(state, bytes) else state)


def check(config: Config) -> list[rewards_lib.Reward]:
  """What a run's rollouts need, before it writes anything: the engine's keys, the reward functions (imported; they
  are returned), the batch as whole groups of num_generations, and prompts that the columns name and that fit."""
  engine_lib.check(config)
  loaded = rewards_lib.load(config)
  check_prompts(config, "train")
  if config.eval_interval > 0:
    check_prompts(config, "eval")
  if config.global_batch_size % config.num_generations:
    raise ConfigError(
      f"global_batch_size={config.global_batch_size} (per_device_batch_size x devices) is not a multiple of "
      f"num_generations={config.num_generations}: each step's batch is whole groups of completions; change either"
    )
  return loaded


def check_prompts(config: Config, split: str) -> None:
  """Reads the split's first prompts through the transform, so a wrong column or an unusable record stops the run
  before it writes anything."""
  tokenizer = tokenizer_lib.check_tokenizer(config)
  if not Prompts(config, tokenizer, split).take(1):
    raise ConfigError(
      f"no prompt of {input_pipeline.describe(config, split == 'train')} fits max_prefill_predict_length="
      f"{config.max_prefill_predict_length}; raise it or give shorter prompts"
    )


# ---------------------------------------------------------------------------------------------- rollouts
def seed(config: Config, step: int, row: int) -> int:
  """The 64-bit sampling seed of a step's row: the same on resume, different for every row and step."""
  low, high = np.random.SeedSequence([config.decode_sampling_seed & 0xFFFFFFFF, step, row]).generate_state(2)
  return int(low) | int(high) << 32


@dataclasses.dataclass
class Rollout:
  """One batch of completions and what was measured on it."""

  prompts: list[dict]  # Prompts' examples, one per prompt
  results: list[engine_lib.Result]  # generation g of prompt p at p * G + g
  scores: np.ndarray  # [completions, reward functions]
  seconds: float  # generating
  reward_seconds: float  # scoring

  def completion_tokens(self, result: engine_lib.Result) -> list[int]:
    return result.tokens + ([] if result.stop_token is None else [result.stop_token])


class Rollouts:
  """The RL step's data: rollouts of the current parameters (batch), and greedy evaluation on held-out prompts."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, params, tokenizer: tokenizer_lib.Tokenizer):
    self.config, self.mesh, self.tokenizer = config, mesh, tokenizer
    self.generations = config.num_generations
    self.prompts_per_step = config.global_batch_size // self.generations
    self.rewards = rewards_lib.load(config)
    self.prompts = Prompts(config, tokenizer, "train")
    self.sampling = Sampling.from_config(config).request_settings()
    self.completion_limit = config.max_target_length - config.max_prefill_predict_length
    self._cast = None
    self.lap_seconds = 0.0  # the training rollouts' time since the last metrics()
    print(f"rollouts: decoding {tokenizer.describe_end()}", flush=True)
    self.engine = engine_lib.Engine(
      config,
      mesh,
      self._decoding(params),
      end_ids=tokenizer.end_ids,
      pad_id=max(tokenizer.pad_id, 0),
      num_tokens=tokenizer.vocab_size,
      detokenize=tokenizer.decode,
      num_slots=config.global_batch_size,
      sampled_logprobs=True,
    )
    self.engine.release()  # Its pool and parameters are loaded for each rollout (_run) and freed after.
    self.batch_sharding = sharding.batch_sharding(mesh, config)
    self.last: Rollout | None = None

  def _decoding(self, params):
    """The parameters as the engine reads them: the training arrays themselves, or on the devices cast to the dtype
    decoding keeps (engine.params_dtype) and, from a circular pipeline's stage-major train state, in the natural
    layer order (state.LayerOrder), in the same shardings."""
    dtype = engine_lib.params_dtype(self.config, self.mesh)
    cast = any(x.dtype != dtype and jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree_util.tree_leaves(params))
    order = state_lib.LayerOrder(self.config)
    if not cast and not order.permuted:
      return params
    if self._cast is None:  # compiled once: the parameters keep their shapes and layout from step to step

      def decoding(p):
        p = order.view(p)
        return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, p)

      self._cast = jax.jit(decoding, out_shardings=jax.tree_util.tree_map(lambda x: x.sharding, params))
    return self._cast(params)

  # ----------------------------------------------------------------------------- training batches
  def batch(self, params, step: int) -> dict[str, jax.Array] | None:
    """The batch of step `step`: rollouts of `params` on the next prompts, scored. None when the data ran out."""
    prompts = self.prompts.take(self.prompts_per_step)
    if len(prompts) < self.prompts_per_step:
      return None
    temperature, top_k, top_p = self.sampling
    requests = [
      engine_lib.Request(
        tuple(int(t) for t in example["tokens"]),
        self.completion_limit,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed(self.config, step, p * self.generations + g),
        logprobs=0,
      )
      for p, example in enumerate(prompts)
      for g in range(self.generations)
    ]
    rollout = self._run(params, prompts, requests, self.generations)
    self.last = rollout
    self.lap_seconds += rollout.seconds + rollout.reward_seconds
    totals = rewards_lib.total(self.rewards, rollout.scores)
    advantages = rewards_lib.group_advantages(totals, self.generations)
    return self._arrays(rollout, advantages)

  def _run(self, params, prompts: list[dict], requests: list[engine_lib.Request], generations: int) -> Rollout:
    jax.block_until_ready(params)  # The update that made them is still running: its time is not the rollout's.
    start = time.perf_counter()
    self.engine.load(self._decoding(params))
    results = self.engine.generate(requests)
    self.engine.release()  # The train step donates the parameters, and needs the pool's memory.
    generated = time.perf_counter()
    texts = [example["prompt"] for example in prompts for _ in range(generations)]
    names = sorted({name for example in prompts for name in example["columns"]})
    columns = {name: [example["columns"].get(name) for example in prompts for _ in range(generations)] for name in names}
    scores = rewards_lib.score(self.rewards, texts, [r.text for r in results], columns)
    return Rollout(prompts, results, scores, generated - start, time.perf_counter() - generated)

  def _arrays(self, rollout: Rollout, advantages: np.ndarray) -> dict[str, jax.Array]:
    rows, length = self.config.global_batch_size, self.config.max_target_length
    out = {name: np.zeros((rows, length), np.int32) for name in ("inputs", "inputs_segmentation", "inputs_position")}
    out |= {name: np.zeros((rows, length), np.int32) for name in ("targets", "targets_segmentation")}
    out |= {name: np.zeros((rows, length), np.float32) for name in ROLLOUT_KEYS}
    for r, result in enumerate(rollout.results):
      prompt = [int(t) for t in rollout.prompts[r // self.generations]["tokens"]]
      completion = rollout.completion_tokens(result)
      logprobs = [lp.logprob for lp in result.logprobs or []]
      if result.stop_token is not None:
        logprobs.append(result.stop_logprob.logprob)
      tokens = prompt + completion
      n, p = len(tokens), len(prompt)
      out["inputs"][r, :n] = tokens
      out["inputs_segmentation"][r, :n] = 1
      out["inputs_position"][r, :n] = np.arange(n)
      out["targets"][r, : n - 1] = tokens[1:]
      out["targets_segmentation"][r, p - 1 : n - 1] = 1
      out["old_logprobs"][r, p - 1 : n - 1] = logprobs
      out["advantages"][r] = advantages[r]
    shape = (rows, length)
    return {
      name: jax.make_array_from_callback(shape, self.batch_sharding, lambda index, a=array: a[index])
      for name, array in out.items()
    }

  def metrics(self, lap_seconds: float | None = None, steps: int = 1) -> dict[str, float]:
    """The last rollout's scalars: rewards (mean and std, in total and per function), completion lengths, the share
    cut by max_target_length, the time and tokens/s of generating (the engine's) and the time of scoring, and the
    prompts skipped so far as longer than max_prefill_predict_length; given the wall time of the `steps` steps since the last
    call (the loop's lap, rollouts included), the time of an update: that less the rollouts made in it, per step."""
    rollout = self.last
    if rollout is None:
      return {}
    totals = rewards_lib.total(self.rewards, rollout.scores)
    lengths = np.asarray([len(rollout.completion_tokens(r)) for r in rollout.results])
    groups = totals.reshape(-1, self.generations)
    mean, std = rewards_lib.mean_and_std(totals)  # rewards of any finite size: np.mean of 1e308s overflows
    out = {
      "rl/reward_mean": mean,
      "rl/reward_std": std,
      "rl/completion_length_mean": float(lengths.mean()),
      "rl/completion_length_max": float(lengths.max()),
      "rl/truncated_fraction": float(np.mean([r.finish_reason == "length" for r in rollout.results])),
      "rl/groups_without_signal": float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
      "rl/rollout_seconds": rollout.seconds,
      "rl/rollout_tokens_per_sec": float(lengths.sum()) / rollout.seconds,
      "rl/reward_seconds": rollout.reward_seconds,
      "rl/prompts_skipped": float(self.prompts.dropped),
    }
    for f, reward in enumerate(self.rewards):
      out[f"rl/reward_{reward.name}_mean"], out[f"rl/reward_{reward.name}_std"] = rewards_lib.mean_and_std(
        rollout.scores[:, f]
      )
    if lap_seconds is not None:
      out["rl/train_seconds_per_update"] = (lap_seconds - self.lap_seconds) / steps
    self.lap_seconds = 0.0
    return out

  # ----------------------------------------------------------------------------- evaluation
  def evaluate(self, params) -> dict[str, float]:
    """Greedy completions of the eval split's prompts (eval_steps batches of eval_batch_size, or one pass with
    eval_steps=-1), scored: the mean of each reward (an accuracy for exact_match and math) and of the total."""
    prompts = Prompts(self.config, self.tokenizer, "eval")
    batches = self.config.eval_steps if self.config.eval_steps > 0 else None
    scores, count = [], 0
    while batches is None or count < batches:
      examples = prompts.take(self.config.eval_batch_size)
      if not examples:
        break
      requests = [engine_lib.Request(tuple(int(t) for t in e["tokens"]), self.completion_limit) for e in examples]
      scores.append(self._run(params, examples, requests, 1).scores)
      count += 1
    if not scores:
      raise ConfigError("the evaluation split gave no prompt that fits max_prefill_predict_length; give eval prompts")
    scores = np.concatenate(scores)
    mean = rewards_lib.mean_and_std(rewards_lib.total(self.rewards, scores))[0]
    out = {"eval/reward": mean, "eval/total_weights": len(scores)}
    return out | {f"eval/reward_{r.name}": rewards_lib.mean_and_std(scores[:, f])[0] for f, r in enumerate(self.rewards)}

  def get_state(self) -> dict:
    return self.prompts.get_state()

  def set_state(self, state: dict | bytes) -> None:
    self.prompts.set_state(state)
    logging.info("RL prompts restored")

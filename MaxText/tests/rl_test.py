"""RL through the train step and train.py (use_rl): rollouts, the step's loss, resume, refusals.

The loss's formulas are checked against float64 NumPy in rl_loss_test.py and the rewards in rl_rewards_test.py; here
the pieces meet. References: the trainer's own forward pass for the sampler's log-probabilities (a different code
path: the engine's paged cache and decode-mode attention), a hand-made rollout for the batch's layout, NumPy for the
ratio of a later iteration, one device for the sharded loss and gradients, one batch for gradient accumulation, and
an uninterrupted run for a run killed with kill -9.
"""

import json
import os
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from flax import linen as nn

from MaxText import cli, sharding, state, train
from MaxText import step as step_lib
from MaxText.common_types import ConfigError, TrainingError
from MaxText.inference import engine as engine_lib
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import models
from MaxText.objectives import losses as losses_lib
from MaxText.objectives import rl as rl_objective
from MaxText.rl import rollouts as rollouts_lib
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, deadline, free_port, metrics_losses, metrics_values, run
from MaxText.tests.helpers import overrides as overrides_of

RL_YML = os.path.join(os.path.dirname(BASE_YML), "rl.yml")


def shorter(prompts, completions, **columns):
  """A reward for the tests: shorter completions score higher (a signal even for a random model)."""
  del prompts, columns
  return [1.0 / (1 + len(c)) for c in completions]


CALLS = []


def raises_later(prompts, completions, **columns):
  """A reward that works for two batches of rollouts, then raises."""
  CALLS.append(len(completions))
  if len(CALLS) > 2:
    raise KeyError("no such thing")
  return [0.0] * len(completions)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  """A byte-level BPE tokenizer.json of sums ("3+4=7"), EOS <|im_end|>, and train/eval json lines {prompt, answer}."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  root = tmp_path_factory.mktemp("rl")
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300,
    special_tokens=["<|endoftext|>", "<|im_end|>", "<s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  hf.train_from_iterator([" ".join(f"{a}+{b}={a + b}" for a in range(20) for b in range(20))] * 3, trainer)
  os.makedirs(root / "hf")
  hf.save(str(root / "hf/tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}
  (root / "hf/tokenizer_config.json").write_text(json.dumps({**settings, "pad_token": "<|endoftext|>"}))
  rng = np.random.default_rng(0)
  for split, n in (("train", 48), ("eval", 6)):
    with open(root / f"{split}.jsonl", "w", encoding="utf-8") as f:
      for a, b in rng.integers(0, 10, (n, 2)):
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return root


def _rl_keys(data, *extra):
  return (
    f"tokenizer_path={data}/hf/tokenizer.json", "tokenizer_type=huggingface", "vocab_size=512",
    "override_model_config=true", "hf_path=json", f"hf_train_files={data}/train.jsonl",
    f"hf_eval_files={data}/eval.jsonl", "use_chat_template=false", "max_prefill_predict_length=8",
    "max_target_length=16", "num_generations=4", "per_device_batch_size=8",
    "reward_functions=['MaxText.tests.rl_test:shorter']", "learning_rate=1e-2", "warmup_steps_fraction=0", *extra,
  )  # fmt: skip


def _config(data, *extra, num_devices=1):
  from MaxText import pyconfig

  return pyconfig.load([RL_YML, *overrides_of(*_rl_keys(data, *extra))], num_devices=num_devices, env={})


def _start(cfg, devices=1):
  """(mesh, model, params placed by the config's layout, tokenizer) of a fresh tiny model."""
  mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
  model = models.Transformer(cfg, mesh)
  _, shardings = state.params_layout(model, cfg, mesh)
  params = jax.device_put(nn.meta.unbox(state.init_params(model, cfg, jax.random.key(0))), shardings)
  return mesh, model, params, tokenizer_lib.check_tokenizer(cfg)


def _logps(model, params, batch, num_tokens, temperature=1.0):
  logits = model.apply({"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])
  return np.asarray(losses_lib.token_logps(logits / temperature, batch["targets"], num_tokens))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_sampler_s_logprobs_equal_the_trainer_s_forward(data, temperature):
  """The engine's log-probability of each completion token it sampled (paged cache, decode mode), of the
  distribution it sampled from (the logits over the temperature), equals the train step's (rl_loss_fn's) forward
  pass over prompt + completion (float32, 1e-5); the batch holds each prompt's num_generations completions, different
  from each other, in rows of one group."""
  cfg = _config(data, f"decode_sampling_temperature={temperature}")
  mesh, model, params, tokenizer = _start(cfg)
  rollouts = rollouts_lib.Rollouts(cfg, mesh, params, tokenizer)
  batch = jax.device_get(rollouts.batch(params, step=0))
  mask = batch["targets_segmentation"] == 1
  assert mask.sum(axis=1).min() >= 1
  got = _logps(model, params, batch, tokenizer.vocab_size, temperature)
  np.testing.assert_allclose(batch["old_logprobs"][mask], got[mask], atol=1e-5, rtol=0)
  assert np.all(batch["old_logprobs"][~mask] == 0)
  groups = batch["inputs"].reshape(-1, cfg.num_generations, cfg.max_target_length)
  assert all(len({row.tobytes() for row in group}) > 1 for group in groups)  # sampled, not greedy
  prompts = batch["inputs"][:, :3].reshape(-1, cfg.num_generations, 3)
  assert np.all(prompts == prompts[:, :1])  # a group shares its prompt
  advantages = batch["advantages"][:, 0].reshape(-1, cfg.num_generations)
  np.testing.assert_allclose(advantages.sum(axis=1), 0, atol=1e-5)  # group-normalised
  assert np.all(batch["advantages"] == batch["advantages"][:, :1])


def test_the_batch_lays_out_prompt_completion_and_stop_token():
  """A hand-made rollout: row = prompt + completion + the stop token, targets shifted by one, the loss mask and the
  old log-probabilities on the completion's targets (the stop token's included), the advantage on every column."""
  rollouts = rollouts_lib.Rollouts.__new__(rollouts_lib.Rollouts)
  rollouts.config = type("C", (), {"global_batch_size": 2, "max_target_length": 8})()
  rollouts.generations = 2
  rollouts.batch_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  lp = engine_lib.TokenLogprob
  stopped = engine_lib.Result([7, 8], "ab", [lp(-0.5, []), lp(-0.25, [])], stop_token=2, stop_logprob=lp(-0.125, []))
  cut = engine_lib.Result([9, 9, 9], "ccc", [lp(-1.0, [])] * 3, finish_reason="length")
  rollout = rollouts_lib.Rollout([{"tokens": np.asarray([1, 5, 6])}], [stopped, cut], np.zeros((2, 1)), 1.0, 0.0)
  batch = jax.device_get(rollouts._arrays(rollout, np.asarray([0.5, -0.5], np.float32)))
  np.testing.assert_array_equal(batch["inputs"], [[1, 5, 6, 7, 8, 2, 0, 0], [1, 5, 6, 9, 9, 9, 0, 0]])
  np.testing.assert_array_equal(batch["targets"], [[5, 6, 7, 8, 2, 0, 0, 0], [5, 6, 9, 9, 9, 0, 0, 0]])
  np.testing.assert_array_equal(batch["inputs_segmentation"], [[1] * 6 + [0] * 2] * 2)
  np.testing.assert_array_equal(batch["inputs_position"][0], [0, 1, 2, 3, 4, 5, 0, 0])
  np.testing.assert_array_equal(batch["targets_segmentation"], [[0, 0, 1, 1, 1, 0, 0, 0]] * 2)
  np.testing.assert_array_equal(batch["old_logprobs"][0], [0, 0, -0.5, -0.25, -0.125, 0, 0, 0])
  np.testing.assert_array_equal(batch["advantages"], [[0.5] * 8, [-0.5] * 8])


def _two_updates(cfg, devices=1):
  """Two train steps on one batch of rollouts (num_iterations=2): (batch, metrics of each, model, params after the
  first, tokenizer)."""
  mesh, model, params, tokenizer = _start(cfg, devices)
  parts = step_lib.build(cfg, jax.devices()[:devices])
  layout = parts.layout
  train_state = state.state_from_params(params, parts.tx, layout, cfg)
  rollouts = rollouts_lib.Rollouts(cfg, mesh, train_state.params, tokenizer)
  batch = rollouts.batch(train_state.params, step=0)
  jitted = step_lib.jit_train_step(
    cfg, mesh, model=parts.model, schedule=parts.schedule, tx=parts.tx, layout=layout, num_tokens=tokenizer.vocab_size
  )
  first_state, first = jitted.fn(train_state, batch)
  after_first = jax.device_get(first_state.params)
  _, second = jitted.fn(first_state, batch)
  return jax.device_get(batch), jax.device_get(first), jax.device_get(second), model, after_first, tokenizer


def test_the_first_update_is_on_policy_and_the_second_uses_the_sampler_s_logprobs(data):
  """num_iterations=2: the first update's ratio is exactly 1 and nothing is clipped; the second's mean ratio is the
  policy after one update against the sampler's log-probabilities, exp(logp - old) over completion tokens, in NumPy."""
  cfg = _config(data, "num_iterations=2", "steps=2", "checkpoint_period=2", "grpo_epsilon=0.001", "epsilon_high=0.001")
  batch, first, second, model, after_first, tokenizer = _two_updates(cfg)
  assert first["learning/rl_importance_ratio"] == 1.0 and first["learning/rl_clip_fraction"] == 0.0
  mask = batch["targets_segmentation"] == 1
  logps = _logps(model, after_first, batch, tokenizer.vocab_size)
  ratio = np.exp(logps.astype(np.float64) - batch["old_logprobs"])[mask].mean()
  assert abs(ratio - 1) > 1e-4  # the policy moved
  np.testing.assert_allclose(second["learning/rl_importance_ratio"], ratio, rtol=2e-5)
  assert second["learning/rl_clip_fraction"] > 0  # a clip range of 0.001 holds some


@pytest.mark.mesh
def test_a_sharded_rl_loss_and_its_gradients_equal_one_device(data):
  """rl_loss_fn (GSPO, token-mean, with the KL and ratios off 1) on 8 devices, fsdp 4 x tensor 2, equals one device:
  the loss within 1e-5 (relative), each gradient within 1e-4 of its tensor's largest entry."""
  keys = ("loss_algo=gspo-token", "loss_agg_mode=token-mean")
  one = _config(data, *keys)
  mesh1, model1, params, tokenizer = _start(one)
  batch = jax.device_get(rollouts_lib.Rollouts(one, mesh1, params, tokenizer).batch(params, step=0))
  batch["old_logprobs"] = batch["old_logprobs"] - 0.05 * (batch["targets_segmentation"] == 1)  # ratios off 1
  batch["advantages"] = batch["advantages"] + 0.5  # not summing to 0 over a group: a loss far from 0
  params = jax.device_get(params)
  results = []
  eight = _config(data, *keys, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", num_devices=8)
  for cfg, devices in ((one, 1), (eight, 8)):
    mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
    model = models.Transformer(cfg, mesh)
    placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    loss = _mean_loss(model, tokenizer.vocab_size)
    results.append(jax.device_get(jax.jit(jax.value_and_grad(loss))(placed, batch)))
  (loss1, grads1), (loss8, grads8) = results
  np.testing.assert_allclose(loss8, loss1, rtol=1e-5)
  for (path, g8), g1 in zip(jax.tree_util.tree_leaves_with_path(grads8), jax.tree_util.tree_leaves(grads1), strict=True):
    scale = float(np.abs(g1).max()) + 1e-6
    np.testing.assert_allclose(g8, g1, atol=1e-4 * scale, rtol=0, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def one_device_updates():
  """_two_updates on one device, once for every mesh it is compared with."""
  cache = {}

  def get(data):
    if not cache:
      cache["one"] = _two_updates(_config(data, "num_iterations=2", "steps=2", "checkpoint_period=2"))
    return cache["one"]

  return get


@pytest.mark.parametrize(
  "mesh_keys",
  [
    ("ici_fsdp_parallelism=2",),
    ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=1"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=1"),
  ],
  ids=["fsdp", "tensor", "pipeline"],
)
@pytest.mark.mesh
def test_rollouts_and_updates_on_two_devices_equal_one(data, mesh_keys, one_device_updates):
  """The engine runs on the training layout of each parallelism (the pipeline's stages included): the same rollouts
  as one device, token for token, and both updates' metrics (the second off-policy) within float32 rounding."""
  keys = ("num_iterations=2", "steps=2", "checkpoint_period=2")
  one = one_device_updates(data)
  two = _two_updates(_config(data, *keys, *mesh_keys, "per_device_batch_size=4", num_devices=2), devices=2)
  for key in ("inputs", "targets_segmentation"):
    np.testing.assert_array_equal(two[0][key], one[0][key], err_msg=key)
  np.testing.assert_allclose(two[0]["old_logprobs"], one[0]["old_logprobs"], atol=1e-5)
  for i in (1, 2):
    for key in ("learning/grad_norm", "learning/rl_kl", "learning/rl_entropy", "learning/rl_importance_ratio"):
      np.testing.assert_allclose(two[i][key], one[i][key], rtol=1e-5, atol=1e-7, err_msg=f"update {i}: {key}")


def _mean_loss(model, num_tokens):
  """(params, batch) -> rl_loss_fn's loss over its denominator, off-policy, the params their own reference."""

  def loss(params, batch):
    total, aux = rl_objective.rl_loss_fn(
      model, params, params, batch, jax.random.key(0), True, on_policy=False, num_tokens=num_tokens
    )
    return total / aux["tokens"]

  return loss


@pytest.mark.parametrize("agg", ["token-mean", "sequence-mean", "sequence-mean-token-mean"])
def test_gradient_accumulation_equals_one_batch(data, agg):
  """Two micro-batches of a batch of rollouts give the update and metrics of the whole batch at once, for each
  aggregation (their denominators add up over micro-batches)."""
  outs = []
  for k in (1, 2):
    # per_device_batch_size is a micro-batch's: 8 rows either way.
    keys = (f"gradient_accumulation_steps={k}", f"per_device_batch_size={8 // k}", f"loss_agg_mode={agg}")
    cfg = _config(data, *keys, "opt_type=sgd")
    mesh, model, params, tokenizer = _start(cfg)
    parts = step_lib.build(cfg, jax.devices()[:1])
    train_state = state.state_from_params(params, parts.tx, parts.layout, cfg)
    batch = rollouts_lib.Rollouts(cfg, mesh, train_state.params, tokenizer).batch(train_state.params, step=0)
    jitted = step_lib.jit_train_step(
      cfg,
      mesh,
      model=parts.model,
      schedule=parts.schedule,
      tx=parts.tx,
      layout=parts.layout,
      num_tokens=tokenizer.vocab_size,
    )
    new_state, metrics = jitted.fn(train_state, batch)
    outs.append(jax.device_get((new_state.params, metrics)))
  (p1, m1), (p2, m2) = outs
  for key in ("learning/loss", "learning/rl_kl", "learning/rl_entropy", "learning/total_weights", "learning/grad_norm"):
    np.testing.assert_allclose(m2[key], m1[key], rtol=1e-5, atol=1e-7, err_msg=key)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(p2), jax.tree_util.tree_leaves(p1), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_lora_rl_keeps_no_reference_copy(data):
  """Under LoRA the reference model is the base with the adapters off: the state holds no copy of the weights
  (nor without a KL penalty), where full fine-tuning with grpo_beta > 0 holds one. LoRA's KL starts at exactly 0
  (fresh adapters change nothing) and grows once the adapters train."""
  for keys, copy in ((("lora_rank=4",), False), (("grpo_beta=0",), False), ((), True)):
    cfg = _config(data, *keys)
    layout = step_lib.build(cfg, jax.devices()[:1]).layout
    assert (layout.abstract.reference_params is not None) == copy, keys
  cfg = _config(data, "lora_rank=4", "num_iterations=2", "steps=2", "checkpoint_period=2")
  _, first, second, *_ = _two_updates(cfg)
  assert first["learning/rl_kl"] == 0.0 and second["learning/rl_kl"] > 0


@pytest.mark.parametrize(
  ("keys", "message"),
  [
    (("decode_sampling_strategy=greedy",), "greedy rollouts make a group's completions all the same"),
    (("num_generations=1",), "num_generations=1"),
    (("num_iterations=2", "steps=3"), "steps=3 (3 steps) is not a multiple of num_iterations=2"),
    (("use_sft=true",), "use_rl=true and use_sft=true"),
    (("loss_algo=ppo",), "loss_algo"),
    (("loss_agg_mode=mean",), "loss_agg_mode"),
    (("reward_functions=[]",), "reward_functions"),
  ],
)
def test_bad_rl_keys_are_refused_in_one_line(data, keys, message):
  with pytest.raises(ConfigError, match=None) as error:
    _config(data, *keys)
  assert message in str(error.value) and "\n" not in str(error.value)


def test_step_counts_are_checked_as_resolved(data):
  """steps=-1 takes learning_rate_schedule_steps, and checkpoint_period matters only when checkpoints are saved."""
  assert _config(data, "steps=-1", "learning_rate_schedule_steps=10", "num_iterations=2").steps == 10
  assert _config(data, "enable_checkpointing=false", "num_iterations=3", "steps=9").num_iterations == 3
  with pytest.raises(ConfigError, match=r"steps=-1 \(9 steps\) is not a multiple of num_iterations=2"):
    _config(data, "steps=-1", "learning_rate_schedule_steps=9", "num_iterations=2")


def test_new_parameters_drop_the_prefix_cache(data):
  """With enable_prefix_caching, the pages a rollout's prompts leave cached hold keys of the parameters it ran on; the
  next rollout, on new parameters and the same prompts, computes them again (no prefix hit): its completions and
  logprobs equal a fresh engine's."""
  cfg = _config(data, "enable_prefix_caching=true", "pagedattn_tokens_per_page=2")
  mesh, model, params, tokenizer = _start(cfg)
  moved = jax.tree_util.tree_map(lambda x: x * 1.5, params)
  rollouts = rollouts_lib.Rollouts(cfg, mesh, params, tokenizer)
  first = jax.device_get(rollouts.batch(params, step=0))
  rollouts.prompts = rollouts_lib.Prompts(cfg, tokenizer, "train")  # the same prompts again
  again = jax.device_get(rollouts.batch(moved, step=0))
  assert rollouts.engine.stats["prefix_hit_tokens"] == 0
  want = jax.device_get(rollouts_lib.Rollouts(cfg, mesh, moved, tokenizer).batch(moved, step=0))
  assert not np.array_equal(first["old_logprobs"], want["old_logprobs"])  # the new parameters differ
  np.testing.assert_array_equal(again["inputs"], want["inputs"])
  np.testing.assert_array_equal(again["old_logprobs"], want["old_logprobs"])


def test_a_batch_of_part_groups_and_a_wrong_column_are_refused(data):
  with pytest.raises(ConfigError, match="not a multiple of num_generations=3"):
    rollouts_lib.check(_config(data, "num_generations=3"))
  with pytest.raises(ConfigError, match="RL reads one prompt column"):
    rollouts_lib.check_prompts(_config(data, "train_data_columns=['answer']"), "train")


NOT_A_PROMPT = [  # (a prompt column's value, how the error shows it)
  (7, "int 7"),
  (None, "null (None)"),
  (2.5, "float 2.5"),
  (True, "bool True"),
  ({"role": "user", "content": "hi"}, "dict {'role': 'user', 'content': 'hi'}"),
  ([1, 2], "a list of int [1, 2]"),
  (["hi", {"role": "user", "content": "x"}], "a list of dict, str ['hi', {'role': 'user', 'content': 'x'}]"),
]


@pytest.mark.parametrize("chat", ["false", "true"])
@pytest.mark.parametrize("column", ["prompt", "messages"])
@pytest.mark.parametrize("value, shown", NOT_A_PROMPT)
def test_a_prompt_neither_text_nor_turns_is_named_with_its_column_and_type(data, value, shown, column, chat):
  """Not "holds turns, which need a chat template" (the wrong cause): the column, what it holds, what is expected."""
  cfg = _config(data, f"use_chat_template={chat}", f"train_data_columns=['{column}']")
  prompt = rollouts_lib.Prompt(cfg, tokenizer_lib.check_tokenizer(cfg), "train_data_columns")
  with pytest.raises(ConfigError) as info:
    prompt({column: value, "answer": "1"})
  assert str(info.value) == (
    f"train_data_columns=['{column}']: a record's '{column}' is {shown}; expected a string, or a list of "
    "{'role', 'content'} turns (or a 'messages' column) with use_chat_template=true"
  )


def test_turns_without_a_chat_template_and_integer_prompts_read_from_a_file(data, tmp_path):
  cfg = _config(data)
  prompt = rollouts_lib.Prompt(cfg, tokenizer_lib.check_tokenizer(cfg), "train_data_columns")
  with pytest.raises(ConfigError, match=r"'prompt' holds turns, which need a chat template; set use_chat_template=true"):
    prompt({"prompt": [{"role": "user", "content": "1+1="}]})
  (tmp_path / "ints.jsonl").write_text("".join(json.dumps({"prompt": i, "answer": "1"}) + "\n" for i in range(4)))
  with pytest.raises(ConfigError, match=r"^train_data_columns=\['prompt'\]: a record's 'prompt' is int 0; expected a"):
    rollouts_lib.check_prompts(_config(data, f"hf_train_files={tmp_path}/ints.jsonl"), "train")


def _train(data, tmp_path, *extra):
  args = [
    sys.executable,
    "MaxText/train.py",
    RL_YML,
    *overrides_of(*_rl_keys(data, f"base_output_directory={tmp_path}", *extra)),
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  return args, env


def test_a_reward_function_that_raises_stops_the_run_in_one_line_and_saves(data, tmp_path):
  """A reward function that raises at the third batch of rollouts: one line naming it, exit 2, and the two steps
  done are saved (the prompts of the failed batch are taken again on resume)."""
  reward = "reward_functions=['MaxText.tests.rl_test:raises_later']"
  args, env = _train(data, tmp_path, "run_name=r", "steps=4", reward, "enable_checkpointing=true")
  proc = run(args, env)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.count("\n") == 1, proc.stderr
  assert "reward function MaxText.tests.rl_test:raises_later raised KeyError" in proc.stderr
  assert "checkpoint 2 is saved: fix it and run the same command to resume" in proc.stderr
  assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == ["2"]


# kill -9: 8 steps of 2 updates per batch of rollouts, a checkpoint every 2 steps.
KILL = ("steps=8", "num_iterations=2", "checkpoint_period=2", "log_period=1", "enable_checkpointing=true")


@pytest.mark.slow
def test_rl_killed_with_kill_9_resumes_bit_exactly(data, tmp_path):
  """train.py with use_rl on 2 devices is killed with SIGKILL once checkpoint 2 is committed; the same command
  resumes from its latest checkpoint, regenerates the same rollouts (their seeds are the step's) and finishes. Every
  loss and mean reward either part logged equals the uninterrupted run's, bit for bit."""
  log = {part: open(tmp_path / f"{part}.log", "w", encoding="utf-8") for part in ("straight", "killed")}  # noqa: SIM115
  procs = {}
  for part in ("straight", "killed"):
    args, env = _train(data, tmp_path, f"run_name={part}", f"metrics_file={tmp_path}/{part}.jsonl", *KILL)
    procs[part] = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log[part], stderr=subprocess.STDOUT)
  try:
    with deadline(240):
      while procs["killed"].poll() is None and not (tmp_path / "killed" / "checkpoints" / "2").is_dir():
        time.sleep(0.01)
      procs["killed"].send_signal(signal.SIGKILL)
      assert procs["straight"].wait() == 0, (tmp_path / "straight.log").read_text()
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
    for f in log.values():
      f.close()
  assert procs["killed"].returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
  assert "8" not in os.listdir(tmp_path / "killed" / "checkpoints")
  args, env = _train(data, tmp_path, "run_name=killed", f"metrics_file={tmp_path}/resumed.jsonl", *KILL)
  resumed = run(args, env)
  assert resumed.returncode == 0, resumed.stderr
  assert f"resumed from {tmp_path}/killed/checkpoints/" in resumed.stdout
  straight = _rewards(tmp_path / "straight.jsonl")
  assert sorted(metrics_losses(tmp_path / "straight.jsonl")) == list(range(8))
  after = _rewards(tmp_path / "resumed.jsonl")
  assert after and min(after) >= 2 and min(after) % 2 == 0, sorted(after)
  for step, values in (_rewards(tmp_path / "killed.jsonl", killed=True) | after).items():
    assert values == straight[step], f"step {step}: {values} != {straight[step]}"


def _rewards(path, killed=False) -> dict[int, tuple]:
  """{step: (loss, mean reward, grad norm)} of a metrics_file."""
  return metrics_values(path, ("learning/loss", "rl/reward_mean", "learning/grad_norm"), killed)


class _Signalled:
  """Rollouts whose batch() gets a SIGTERM in a reward and ends as `ends` says, the signal's exception caught: a
  batch made anyway (math-verify's parser catches every Exception and scores the text 0), a reward error made of it
  (the old score() did), or a KeyboardInterrupt a reward function raised (no signal)."""

  def __init__(self, ends: str):
    self.ends = ends

  def batch(self, params, step):
    if self.ends == "KeyboardInterrupt":
      raise KeyboardInterrupt
    try:
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(30)  # the handler raises StopRequest.Interrupted here
    except Exception as e:  # noqa: BLE001 (as the code under the reward's call may)
      if self.ends == "reward error":
        raise ConfigError(f"reward function m:f raised {type(e).__name__}") from None
    return {"inputs": np.zeros((1, 1))}

  def get_state(self):
    return {}


@pytest.mark.parametrize(
  "ends, line",
  [
    ("batch", "preempted (SIGTERM) while waiting for the data of step 3"),
    ("reward error", "preempted (SIGTERM) while waiting for the data of step 3"),
    ("KeyboardInterrupt", "interrupted (SIGINT) while waiting for the data of step 3"),
  ],
)
def test_a_signal_during_rollouts_wins_over_what_the_rewards_made_of_it(ends, line):
  """train._next_batch: the batch is dropped and the run stops as preempted (here with no manager, so nothing is
  saved), whatever the data's code did with the signal's exception."""
  config = types.SimpleNamespace(use_rl=True, dataset_type="hf", num_epoch=1)
  run_ = types.SimpleNamespace(manager=None, first_step=0, config=config, data=_Signalled(ends))
  stop = cli.StopRequest()
  try:
    with deadline(20), pytest.raises(TrainingError) as info:
      train._next_batch(run_, stop, types.SimpleNamespace(params=None), 3)
  finally:
    stop.restore()
  assert str(info.value) == f"{line}; no checkpoint is saved: run the same command again"


SLOW_REWARD = '''
import os, time

calls = 0


def slow_third(prompts, completions, **columns):
  """rl_test's `shorter`; with SLOW_REWARD_MARKER set, its third call (step 2's) writes that file and sleeps."""
  global calls
  calls += 1
  if calls == 3 and os.environ.get("SLOW_REWARD_MARKER"):
    open(os.environ["SLOW_REWARD_MARKER"], "w").close()
    time.sleep(300)
  return [1.0 / (1 + len(c)) for c in completions]
'''


@pytest.mark.slow
def test_sigterm_during_a_reward_call_saves_exits_1_and_the_resumed_run_regenerates_the_batch(data, tmp_path):
  """A preemption while a reward function runs (step 2's rollouts) wins over the reward: the two steps done are
  saved with the prompts' position from before step 2, exit 1 with the preemption's line (not the reward's error,
  exit 2, as before). The same command resumes at step 2 and makes the same rollouts: every loss, mean reward and
  gradient norm of either part equals an uninterrupted run's, bit for bit."""
  (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
  marker = tmp_path / "sleeping"

  def command(name, metrics, sleeps=False):
    keys = ("steps=4", "enable_checkpointing=true", "reward_functions=['slow_rewards:slow_third']")
    args, env = _train(data, tmp_path, f"run_name={name}", f"metrics_file={tmp_path}/{metrics}.jsonl", *keys)
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    if sleeps:
      env["SLOW_REWARD_MARKER"] = str(marker)
    return args, env

  log = {part: open(tmp_path / f"{part}.log", "w", encoding="utf-8") for part in ("straight", "preempted")}  # noqa: SIM115
  procs = {}
  for part in ("straight", "preempted"):
    args, env = command(part, part, sleeps=part == "preempted")
    procs[part] = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log[part], stderr=subprocess.PIPE, text=True)
  try:
    with deadline(240):
      while procs["preempted"].poll() is None and not marker.exists():
        time.sleep(0.05)
      procs["preempted"].send_signal(signal.SIGTERM)
      _, stderr = procs["preempted"].communicate()
      assert procs["straight"].wait() == 0, procs["straight"].stderr.read()
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
    for f in log.values():
      f.close()
  assert procs["preempted"].returncode == 1, stderr[-3000:]
  assert stderr == (
    "error: preempted (SIGTERM) while waiting for the data of step 2; checkpoint 2 is saved: run the same command "
    "again to resume\n"
  )
  assert os.listdir(tmp_path / "preempted" / "checkpoints") == ["2"]
  args, env = command("preempted", "resumed")
  resumed = run(args, env)
  assert resumed.returncode == 0, resumed.stderr
  assert f"resumed from {tmp_path}/preempted/checkpoints/2" in resumed.stdout
  straight = _rewards(tmp_path / "straight.jsonl")
  parts = _rewards(tmp_path / "preempted.jsonl") | _rewards(tmp_path / "resumed.jsonl")
  assert sorted(straight) == sorted(parts) == [0, 1, 2, 3]
  assert parts == straight


@pytest.mark.slow
def test_two_processes_roll_out_and_train_like_one(data, tmp_path):
  """A job of 2 processes x 2 devices (fsdp across them) makes the rollouts of 1 process x 4 devices, the same
  completions on every process, and takes the same updates: rewards equal, losses and gradient norms within 1e-5."""
  from MaxText.tests.distributed_test import finish, log_tail

  port = free_port()
  common = ("steps=2", "per_device_batch_size=2", "log_period=1")

  def start(name, devices, *keys, job=None):
    args, env = _train(data, tmp_path, f"run_name={name}", f"metrics_file={tmp_path}/{name}.jsonl", *common, *keys)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if job is not None:
      env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_COUNT="2", JAX_PROCESS_ID=str(job))
    with open(tmp_path / f"{name}.log", "w", encoding="utf-8") as log:
      return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

  two = ("dcn_fsdp_parallelism=2", "dcn_data_parallelism=1", "ici_fsdp_parallelism=2")
  codes = finish([start("two", 2, *two, job=0), start("two_1", 2, *two, "run_name=two", job=1)])
  assert codes == [0, 0], log_tail(tmp_path, "two") + log_tail(tmp_path, "two_1")
  assert finish([start("one", 4, "ici_fsdp_parallelism=4")]) == [0], log_tail(tmp_path, "one")
  one, split = _rewards(tmp_path / "one.jsonl"), _rewards(tmp_path / "two.jsonl")
  assert sorted(one) == sorted(split) == [0, 1]
  for step, (loss, reward, norm) in one.items():
    assert split[step][1] == reward, step  # the same completions
    assert split[step][0] == pytest.approx(loss, rel=1e-5, abs=1e-7) and split[step][2] == pytest.approx(norm, rel=1e-5)

"""The training objectives' registry and interface (MaxText/objectives/): the key and MaxText's flags resolve to one
objective, an objective registered by a test trains, evaluates, checkpoints and resumes with no other file edited,
and the evaluation over the eval split equals a plain float64 loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import objectives, pyconfig, train
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.input_pipeline.synthetic import SyntheticIterator
from MaxText.objectives import base, dpo, lm, rl, sft
from MaxText.objectives import losses as losses_lib
from MaxText.tests.helpers import BASE_YML, config, overrides, source_lines_matching


# ------------------------------------------------------------------------------------------ the key
def test_the_objectives_are_the_package_modules():
  assert objectives.names() == ["dpo", "lm", "rl", "sft"]
  kinds = {"lm": lm.LanguageModelling, "sft": sft.SupervisedFineTuning, "dpo": dpo.DirectPreference}
  for name, kind in kinds.items():
    assert type(objectives.get(config(f"objective={name}", "dataset_type=hf"))) is kind
  assert rl.OBJECTIVE.name == "rl"
  assert all(issubclass(kind, base.Objective) for kind in (*kinds.values(), rl.OBJECTIVE))


@pytest.mark.parametrize(
  "keys, objective",
  [((), "lm"), (("use_sft=true",), "sft"), (("use_dpo=true",), "dpo"), (("objective=sft", "use_sft=true"), "sft")],
)
def test_maxtexts_flags_and_the_key_resolve_to_one_objective(keys, objective):
  cfg = config("dataset_type=hf", *keys)
  assert cfg.objective == objective
  assert (cfg.use_sft, cfg.use_dpo, cfg.use_rl) == (objective == "sft", objective == "dpo", objective == "rl")


@pytest.mark.parametrize(
  "keys, message",
  [
    (("objective=ppo",), "objective='ppo' is not supported; choose one of 'dpo', 'lm', 'rl', 'sft'"),
    (("objective=dpo", "use_sft=true"), "objective=dpo and use_sft=true: a run trains for one objective; set one"),
    (("use_dpo=true", "use_sft=true"), "use_dpo=true and use_sft=true: a run trains for one objective; set one"),
    (("objective=sft", "dataset_type=synthetic"), "objective=sft trains on conversations"),
  ],
)
def test_a_wrong_objective_is_refused_in_one_line(keys, message):
  with pytest.raises(ConfigError) as error:
    pyconfig.parse([BASE_YML, *overrides("dataset_type=hf", *keys)], env={})
  assert message in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ a throwaway objective
class PositionWeighted(lm.LanguageModelling):
  """Language modelling with each target weighted 1 + position % 3: a loss no module of the package has."""

  name = "position_weighted"

  def loss(
    self, model, params, batch, dropout_rng, *, reference_params=None, step=None, num_tokens=None, deterministic=False
  ):  # noqa: PLR0913
    logits, _ = losses_lib.forward(model, params, batch, dropout_rng, deterministic=deterministic)
    weights = jnp.where(batch["targets_segmentation"] != 0, 1.0 + batch["inputs_position"] % 3, 0.0)
    xent = losses_lib.cross_entropy(logits, batch["targets"])
    return jnp.sum(weights * xent), {"tokens": jnp.sum(weights), "weighted_targets": jnp.sum(weights > 0)}

  def step_metrics(self, aux, denominator):
    return {"learning/mean_weight": denominator / aux["weighted_targets"]}

  def eval_loss(self, model, params, reference_params, batch):
    loss, aux = self.loss(model, params, batch, jax.random.key(0), deterministic=True)
    return loss, aux["tokens"], {}

  def eval_scalars(self, avg_loss, weight, means):
    return {"eval/weighted_loss": avg_loss, "eval/total_weights": weight}

  def eval_line(self, scalars, when):
    return f"eval {when}: weighted loss {scalars['eval/weighted_loss']:.4f}"


@pytest.fixture
def registered():
  objectives.register(PositionWeighted)
  yield PositionWeighted.name
  objectives.unregister(PositionWeighted.name)


def _weighted_loss_float64(cfg, params, batch) -> float:
  """The throwaway objective's loss written out in NumPy float64 from the model's logits."""
  from MaxText.layers import models

  logits, _ = models.Transformer(cfg).apply(
    {"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"], deterministic=True,
    mutable=["intermediates"],
  )  # fmt: skip
  x = np.asarray(logits, np.float64)
  logz = np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1)) + x.max(-1)
  xent = logz - np.take_along_axis(x, np.asarray(batch["targets"])[..., None], -1)[..., 0]
  weights = np.where(np.asarray(batch["targets_segmentation"]) != 0, 1.0 + np.asarray(batch["inputs_position"]) % 3, 0.0)
  return float(np.sum(weights * xent) / np.sum(weights))


def test_a_registered_objective_trains_on_its_own_loss(registered, capsys, tmp_path):
  """Its loss (against float64), its own step metric (the mean weight, against the batch's), its evaluation line."""
  import json

  cfg = config(f"objective={registered}", "steps=1", "eval_interval=1", "eval_steps=1", f"metrics_file={tmp_path}/m.jsonl")
  summary = train.train(cfg, jax.devices()[:1])
  parts = step_lib.build(cfg, jax.devices()[:1])
  params = state_lib.init_state(parts.model, cfg, parts.tx, parts.layout).params
  batch = jax.device_get(next(SyntheticIterator(cfg, parts.mesh, 0)))
  (step, loss), *_ = summary.losses
  assert step == 0
  np.testing.assert_allclose(loss, _weighted_loss_float64(cfg, params, batch), rtol=1e-5)
  assert set(summary.last_eval) == {"eval/weighted_loss", "eval/total_weights"}
  assert "eval after step 0: weighted loss" in capsys.readouterr().out
  (record,) = [r for r in map(json.loads, open(tmp_path / "m.jsonl", encoding="utf-8")) if "learning/mean_weight" in r]
  in_loss = np.asarray(batch["targets_segmentation"]) != 0
  mean_weight = np.sum(np.where(in_loss, 1 + np.asarray(batch["inputs_position"]) % 3, 0)) / np.sum(in_loss)
  np.testing.assert_allclose(record["learning/mean_weight"], mean_weight, rtol=1e-6)


@pytest.mark.slow
def test_a_registered_objective_checkpoints_and_resumes_exactly(registered, tmp_path):
  common = (f"objective={registered}", "enable_checkpointing=true", "async_checkpointing=false", "checkpoint_period=2")
  common += (f"base_output_directory={tmp_path}", "log_period=1", "learning_rate_schedule_steps=4")
  straight = train.train(config(*common, "run_name=a", "steps=4"), jax.devices()[:1])
  train.train(config(*common, "run_name=b", "steps=2"), jax.devices()[:1])
  resumed = train.train(config(*common, "run_name=b", "steps=4", "eval_interval=4", "eval_steps=1"), jax.devices()[:1])
  assert resumed.first_step == 2
  assert resumed.losses[-2:] == straight.losses[-2:]
  assert resumed.last_eval["eval/total_weights"] > 0


# ------------------------------------------------------------------------------------------ the evaluation
@pytest.mark.mesh
def test_evaluate_matches_a_plain_loop_over_the_eval_batches():
  """Objective.evaluate (jitted, sharded over 2 devices) = float64 mean of unjitted per-batch loss sums: the
  aggregation over batches and devices (the loss itself is eval_step's in both; lm's is checked elsewhere)."""
  from flax import linen as nn

  from MaxText import input_pipeline, sharding
  from MaxText.layers import models

  cfg = config("eval_interval=1", "eval_steps=3", "eval_per_device_batch_size=2", "ici_fsdp_parallelism=2", num_devices=2)
  mesh = sharding.create_mesh(cfg, jax.devices()[:2])
  model = models.Transformer(cfg, mesh)
  boxed = models.Transformer(cfg).init({"params": jax.random.key(1)}, *models.init_inputs(1, cfg.max_target_length))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = jax.device_put(nn.meta.unbox(boxed)["params"], replicated)
  eval_fn = jax.jit(lambda p, r, b: step_lib.eval_step(model, p, r, b))
  state = state_lib.TrainState(step=0, params=params, opt_state=None)
  got = objectives.get(cfg).evaluate(mesh, eval_fn, state, None, step=0)
  total, tokens = 0.0, 0
  for i, batch in enumerate(input_pipeline.create_eval_iterator(cfg, mesh)):
    if i == 3:
      break
    loss_sum, count, _ = step_lib.eval_step(models.Transformer(cfg), params, None, jax.device_get(batch))
    total, tokens = total + float(loss_sum), tokens + int(count)
  assert got["eval/total_weights"] == tokens == 3 * 4 * cfg.max_target_length
  np.testing.assert_allclose(got["eval/avg_loss"], total / tokens, rtol=1e-6)
  np.testing.assert_allclose(got["eval/perplexity"], np.exp(total / tokens), rtol=1e-6)


def test_the_flops_of_an_objective_scale_one_training_pass():
  """DPO: two sequences per row, each with the reference's forward pass too: 2 x (3 + 1) / 3 of a training pass; RL:
  (3 + 1) / 3 with a KL penalty (the reference's forward pass), 1 without; SFT: language modelling's."""
  from MaxText import metrics

  one = metrics.training_flops_per_device(config()).total
  assert objectives.get(config()).flops().total == one
  assert objectives.get(config("objective=sft", "dataset_type=hf")).flops().total == one
  assert objectives.get(config("objective=dpo", "dataset_type=hf")).flops().total == pytest.approx(one * 8 / 3)
  rl_keys = ("objective=rl", "dataset_type=hf", "reward_functions=['exact_match']", "decode_sampling_strategy=weighted")
  assert objectives.get(config(*rl_keys, "grpo_beta=0.04")).flops().total == pytest.approx(one * 4 / 3)
  assert objectives.get(config(*rl_keys, "grpo_beta=0")).flops().total == one


# ------------------------------------------------------------------------------------------ the house
def test_outside_the_objectives_and_the_config_layer_no_module_names_maxtexts_flags():
  """use_sft, use_dpo and use_rl are the config layer's to resolve into `objective`, and each objective's own
  module's; any other module reads the objective (objectives.get) instead, in code, strings and comments alike."""
  allowed = ("MaxText/objectives/", "MaxText/config_parse.py", "MaxText/config_derive.py", "MaxText/config_validate.py")
  named = source_lines_matching(r"\buse_(sft|dpo|rl)\b", allowed)
  assert not named, named

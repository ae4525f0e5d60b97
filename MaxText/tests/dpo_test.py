"""DPO: the loss against a float64 NumPy reference, preference records, packed pairs, and the command line."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import input_pipeline
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.input_pipeline import sft, text_pipeline
from MaxText.objectives import dpo as dpo_lib
from MaxText.tests.helpers import config, metrics_losses
from MaxText.tests.sft_test import CHATML, _sft_args, _train, _write_jsonl, assert_refused, files  # noqa: F401 (a fixture)

BETA, SMOOTHING = 0.3, 0.2


def _packed_pairs(length=12):
  """A hand-packed batch of 2 rows x 2 sides: row 0 holds pairs 1 and 2, row 1 pair 1 and padding. Targets before
  each response (its prompt) have segmentation 0."""
  segments = {
    "chosen": [[1] * 5 + [2] * 6 + [0], [1] * 9 + [0] * 3],
    "rejected": [[1] * 7 + [2] * 4 + [0], [1] * 4 + [0] * 8],
  }
  prompt = {"chosen": [[2, 3], [4]], "rejected": [[2, 1], [2]]}  # prompt targets per (row, segment)
  batch = {}
  for side, rows in segments.items():
    seg = np.asarray(rows, np.int32)
    pos = np.zeros_like(seg)
    target_seg = seg.copy()
    for r in range(2):
      for s in range(1, seg[r].max() + 1):
        where = np.flatnonzero(seg[r] == s)
        pos[r, where] = np.arange(len(where))
        target_seg[r, where[: prompt[side][r][s - 1]]] = 0
    batch[f"{side}_inputs_segmentation"], batch[f"{side}_inputs_position"] = seg, pos
    batch[f"{side}_targets_segmentation"] = target_seg
    tokens = np.random.default_rng(len(side)).integers(0, 40, seg.shape).astype(np.int32)
    batch[f"{side}_inputs"], batch[f"{side}_targets"] = tokens, np.roll(tokens, -1, axis=1)
  return batch


def _numpy_dpo(logits, reference_logits, batch):
  """Float64: loss, metrics and d loss / d policy logits, pair by pair."""

  def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

  sides = ("chosen", "rejected")
  targets = np.concatenate([batch[f"{s}_targets"] for s in sides])
  seg = np.concatenate([batch[f"{s}_inputs_segmentation"] for s in sides])
  mask = np.concatenate([batch[f"{s}_targets_segmentation"] for s in sides]) != 0
  logp, ref_logp = log_softmax(logits), log_softmax(reference_logits)
  rows = targets.shape[0] // 2
  loss, grad = 0.0, np.zeros(logits.shape)
  metrics = dict.fromkeys(["tokens", *dpo_lib.METRICS], 0.0)
  for r in range(rows):
    for s in range(1, seg[r].max() + 1):
      where = {i: (seg[r + i * rows] == s) & mask[r + i * rows] for i in (0, 1)}

      def seq(lp, i, where=where, r=r):
        t = np.flatnonzero(where[i])
        return lp[r + i * rows, t, targets[r + i * rows, t]].sum()

      chosen = BETA * (seq(logp, 0) - seq(ref_logp, 0))
      rejected = BETA * (seq(logp, 1) - seq(ref_logp, 1))
      d = chosen - rejected
      sigmoid = 1 / (1 + np.exp(-d))
      loss += -(1 - SMOOTHING) * np.log(sigmoid) - SMOOTHING * np.log(1 - sigmoid)
      dloss_dd = -(1 - SMOOTHING) * (1 - sigmoid) + SMOOTHING * sigmoid
      for i, sign in ((0, 1.0), (1, -1.0)):  # d log p(target) / d logits = onehot - softmax
        for t in np.flatnonzero(where[i]):
          row = r + i * rows
          onehot = np.eye(logits.shape[-1])[targets[row, t]]
          grad[row, t] += dloss_dd * sign * BETA * (onehot - np.exp(logp[row, t]))
      metrics["tokens"] += 1
      metrics["dpo_rewards_chosen"] += chosen
      metrics["dpo_rewards_rejected"] += rejected
      metrics["dpo_reward_margin"] += d
      metrics["dpo_reward_accuracy"] += float(d > 0)
  return loss, metrics, grad


def test_dpo_loss_and_gradients_equal_a_float64_numpy_reference():
  cfg = config("use_dpo=true", f"dpo_beta={BETA}", f"dpo_label_smoothing={SMOOTHING}", "dataset_type=hf")
  batch = _packed_pairs()
  both = {k: np.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in input_pipeline.BATCH_KEYS}
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((4, 12, 40)).astype(np.float32) * 3
  reference_logits = logits + rng.standard_normal(logits.shape).astype(np.float32)

  def loss(x):
    return dpo_lib.dpo_loss_from_logits(cfg, x, jnp.asarray(reference_logits), both)

  (got_loss, aux), got_grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logits))
  want_loss, want_metrics, want_grad = _numpy_dpo(logits, reference_logits, batch)
  assert want_metrics["tokens"] == int(aux["tokens"]) == 3
  assert 0 < want_metrics["dpo_reward_accuracy"] < 3, "the test wants pairs ranked both ways"
  np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5)
  for name in dpo_lib.METRICS:
    np.testing.assert_allclose(float(aux[name]), want_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
  np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-4, atol=1e-7)


def _model_and_params(cfg, seed=0):
  from MaxText.layers import models

  model = models.Transformer(cfg)
  params = model.init({"params": jax.random.key(seed)}, *models.init_inputs(1, cfg.max_target_length))["params"]
  return model, params


def test_dpo_starts_at_log_2_and_a_step_prefers_the_chosen(files):  # noqa: F811
  """With the policy equal to the reference every margin is 0 (loss log 2 per pair); one gradient step on
  the pairs raises their margins."""
  cfg = config("use_dpo=true", "dataset_type=hf", "vocab_size=512", "override_model_config=true")
  batch = next(iter(_pair_batches(files, 4, packing=False)))
  model, params = _model_and_params(cfg)
  loss, aux = dpo_lib.dpo_loss_fn(model, params, params, batch, jax.random.key(0), deterministic=True)
  assert int(aux["tokens"]) == 4
  np.testing.assert_allclose(float(loss), 4 * np.log(2), rtol=1e-6)
  assert float(aux["dpo_reward_margin"]) == 0.0

  grads = jax.grad(lambda p: dpo_lib.dpo_loss_fn(model, p, params, batch, jax.random.key(0), True)[0])(params)
  stepped = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
  _, after = dpo_lib.dpo_loss_fn(model, stepped, params, batch, jax.random.key(0), deterministic=True)
  assert float(after["dpo_reward_margin"]) > 0


PAIRS = [
  {"prompt": "Which book? In the beginning", "chosen": "Genesis", "rejected": "Hamlet"},
  {"prompt": "Who speaks this line? To be, or not", "chosen": " Hamlet", "rejected": " Ophelia and Genesis"},
  {"prompt": "", "chosen": "x y", "rejected": "y"},
  {"prompt": "A longer prompt about the sea and the sun", "chosen": "sun", "rejected": "sea sea"},
]


def _preference(files, template=None, columns=("prompt", "chosen", "rejected")):  # noqa: F811
  path, kind = (files / "hf/tokenizer.json", "huggingface")
  return sft.Preference(str(path), kind, columns, "train_data_columns", template, True, True, True)


def _pair_batches(files, rows, packing, template=CHATML, pairs=PAIRS):  # noqa: F811
  dataset = text_pipeline.make_dataset(
    pairs, tokenize=_preference(files, template), length=64, rows=rows, seed=0, num_epochs=1, process_index=0,
    process_count=1, shuffle=False, packing=packing, examples="preferences",
  )  # fmt: skip
  return list(dataset)


def test_preference_records_mask_each_response(files):  # noqa: F811
  import transformers

  reference = transformers.AutoTokenizer.from_pretrained(str(files / "hf"))
  tok = _preference(files)
  tok._load()
  hf = tok._loaded[0]
  plain = tok(PAIRS[0])
  head = [hf.bos_id, *hf.encode(PAIRS[0]["prompt"])]
  np.testing.assert_array_equal(plain["chosen_tokens"], [*head, *hf.encode("Genesis"), hf.eos_id])
  np.testing.assert_array_equal(plain["chosen_mask"], [0] * len(head) + [1] * (len(hf.encode("Genesis")) + 1))

  templated = _preference(files, CHATML)(PAIRS[1])
  for side in ("chosen", "rejected"):
    turns = [{"role": "user", "content": PAIRS[1]["prompt"]}, {"role": "assistant", "content": PAIRS[1][side]}]
    want = reference.apply_chat_template(turns)["input_ids"]
    prompt = reference.apply_chat_template(turns[:1], add_generation_prompt=True)["input_ids"]
    np.testing.assert_array_equal(templated[f"{side}_tokens"], want)
    np.testing.assert_array_equal(templated[f"{side}_mask"], [0] * len(prompt) + [1] * (len(want) - len(prompt)))

  whole = {"chosen": "Which book? Genesis", "rejected": "Which book? Hamlet"}
  pair = _preference(files, None, ("chosen", "rejected"))(whole)
  shared = sft._common_prefix(list(pair["chosen_tokens"]), list(pair["rejected_tokens"]))
  assert 0 < shared and pair["chosen_mask"].tolist() == [0] * shared + [1] * (len(pair["chosen_tokens"]) - shared)

  with pytest.raises(ConfigError, match="has no column 'rejected'"):
    _preference(files)({"prompt": "a", "chosen": "b"})
  with pytest.raises(ConfigError, match="no tokens after its prompt"):
    _preference(files, None, ("chosen", "rejected"))({"chosen": "same", "rejected": "same"})
  with pytest.raises(ConfigError, match="does not name preference pairs"):
    sft.check_preference_columns(["prompt", "chosen"], "train_data_columns")


def test_packed_and_unpacked_pairs_give_the_same_loss_and_gradients(files):  # noqa: F811
  cfg = config("use_dpo=true", "dataset_type=hf", "vocab_size=512", "override_model_config=true", "dpo_beta=0.5")
  model, params = _model_and_params(cfg)
  _, reference = _model_and_params(cfg, seed=1)
  packed, unpacked = _pair_batches(files, 1, True), _pair_batches(files, 4, False)
  assert len(unpacked) == 1 and len(packed) < 4 and packed[0]["chosen_inputs_segmentation"].max() > 1

  def summed(batches):
    def total(p):
      losses = [dpo_lib.dpo_loss_fn(model, p, reference, b, jax.random.key(0), deterministic=True) for b in batches]
      return sum(loss for loss, _ in losses), sum(aux["tokens"] for _, aux in losses)

    (loss, pairs), grads = jax.value_and_grad(total, has_aux=True)(params)
    return loss, pairs, grads

  loss_p, pairs_p, grads_p = summed(packed)
  loss_u, pairs_u, grads_u = summed(unpacked)
  assert int(pairs_p) == int(pairs_u) == len(PAIRS)
  np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _dpo_args(files, tmp_path, *extra):  # noqa: F811
  _write_jsonl(tmp_path / "pairs.jsonl", PAIRS * 10)
  _write_jsonl(tmp_path / "pairs_eval.jsonl", PAIRS)
  files_ = (f"hf_train_files={tmp_path}/pairs.jsonl", f"hf_eval_files={tmp_path}/pairs_eval.jsonl")
  args = _sft_args(files, tmp_path, *files_, *extra)
  return [args[0].replace("sft.yml", "dpo.yml"), *args[1:]]


@pytest.mark.slow
def test_dpo_from_a_checkpoint_trains_evaluates_and_resumes_exactly(files, tmp_path):  # noqa: F811
  """SFT for 4 steps, then configs/dpo.yml from its parameters: the reward accuracy and margin are logged, the
  loss falls from log 2, and a run stopped at step 4 and resumed (its reference model restored from the
  checkpoint) repeats the uninterrupted run's losses."""
  rc, _, err = _train(_sft_args(files, tmp_path, "run_name=sft", "steps=4", "enable_checkpointing=true"))
  assert rc == 0, err
  start = f"load_parameters_path={tmp_path}/out/sft/checkpoints/4/items"
  common = (start, "learning_rate=3e-3", "learning_rate_schedule_steps=8", "enable_checkpointing=true")
  common += ("checkpoint_period=4", "eval_interval=4", "eval_steps=1", "per_device_batch_size=2")
  args = _dpo_args(files, tmp_path, "run_name=a", "steps=8", f"metrics_file={tmp_path}/a.jsonl", *common)
  rc, out, err = _train(args)
  assert rc == 0, err
  logged = [json.loads(line) for line in open(tmp_path / "a.jsonl", encoding="utf-8")]
  steps = {m["step"]: m for m in logged if "learning/loss" in m}
  np.testing.assert_allclose(steps[0]["learning/loss"], np.log(2), rtol=1e-6)
  assert steps[0]["learning/dpo_reward_margin"] == 0.0
  assert steps[7]["learning/loss"] < np.log(2) and steps[7]["learning/dpo_reward_accuracy"] > 0.5
  evals = [m for m in logged if "eval/dpo_reward_accuracy" in m]
  assert [m["step"] for m in evals] == [3, 7] and "DPO loss" in out

  first = _dpo_args(files, tmp_path, "run_name=b", "steps=4", f"metrics_file={tmp_path}/b.jsonl", *common)
  assert _train(first)[0] == 0
  resumed = _dpo_args(files, tmp_path, "run_name=b", "steps=8", f"metrics_file={tmp_path}/b.jsonl", *common)
  rc, out, err = _train(resumed)
  assert rc == 0 and "resumed from" in out, err
  assert metrics_losses(tmp_path / "b.jsonl") == metrics_losses(tmp_path / "a.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize(
  "change, message",
  [
    ("train_data_columns=['prompt','chosen']", "train_data_columns=['prompt', 'chosen'] does not name preference pairs"),
    ("train_data_columns=['prompt','chosen','reject']", "does not name preference pairs"),
    ("dpo_beta=0", "dpo_beta=0.0 must be > 0"),
    ("use_sft=true", "use_dpo=true and use_sft=true"),
    ("no_rejected", "train_data_columns=['prompt', 'chosen', 'rejected']: a record has no column 'rejected'"),
  ],
)
def test_bad_dpo_input_exits_2_with_one_line_and_writes_nothing(files, tmp_path, change, message):  # noqa: F811
  args = _dpo_args(files, tmp_path, "run_name=bad", "steps=2", "enable_checkpointing=true")
  if change == "no_rejected":
    _write_jsonl(tmp_path / "pairs.jsonl", [{k: v for k, v in p.items() if k != "rejected"} for p in PAIRS])
  else:
    args.append(change)
  assert_refused(args, tmp_path, message)


def test_dpo_under_lora_takes_the_base_as_its_reference(files):  # noqa: F811
  """No copy of the weights: the state holds no reference_params, the loss starts at log 2 with fresh adapters
  (the policy is the base), and a train step moves the adapters alone and raises the margin."""
  from MaxText import lora
  from MaxText import state as state_lib

  cfg = config("use_dpo=true", "dataset_type=hf", "vocab_size=512", "override_model_config=true", "lora_rank=4",
               "learning_rate=3e-2", "warmup_steps_fraction=0", "steps=2")  # fmt: skip
  mesh, model, schedule, tx, layout = step_lib.build(cfg, jax.devices()[:1])
  state = state_lib.init_state(model, cfg, tx, layout)
  assert state.reference_params is None and layout.abstract.reference_params is None
  batch = next(iter(_pair_batches(files, 4, packing=False)))
  step = jax.jit(lambda s, b: step_lib.train_step(model, cfg, tx, schedule, s, b))
  new_state, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["learning/loss"]), np.log(2), rtol=1e-6)
  _, metrics = step(new_state, batch)
  assert float(metrics["learning/dpo_reward_margin"]) > 0
  jax.tree.map(np.testing.assert_array_equal, lora.partition(new_state.params)[1], lora.partition(state.params)[1])


def test_a_pair_cut_before_its_responses_is_dropped(files):  # noqa: F811
  long = {"prompt": "Which book? " + "In the beginning " * 40, "chosen": "Genesis", "rejected": "Hamlet"}
  batches = _pair_batches(files, 5, packing=False, pairs=[*PAIRS, long])
  assert len(batches) == 0, "five rows need five pairs: the long one must be gone"
  batch = _pair_batches(files, 4, packing=False, pairs=[*PAIRS, long])[0]
  assert all(batch[f"{side}_targets_segmentation"].any(axis=1).all() for side in ("chosen", "rejected"))


def test_pairs_of_which_none_fits_are_one_error_not_a_spin(files, tmp_path):  # noqa: F811
  """Pairs whose prompts pass max_target_length=64: check() refuses them, and an iterator made without check()
  raises the same error instead of reading forever. The length named is the prompt's tokens as transformers renders
  it (the responses' first target); one less is refused, at it a batch of pairs comes out."""
  import transformers

  from MaxText.tests.sft_test import _first_batch_or_error

  rng = np.random.default_rng(0)
  words = "Which book is this verse from the sea sun moon".split()
  pairs = [{"prompt": " ".join(rng.choice(words, 150 + i)), "chosen": "Genesis", "rejected": "Hamlet"} for i in range(8)]
  _write_jsonl(tmp_path / "pairs.jsonl", pairs)
  reference = transformers.AutoTokenizer.from_pretrained(str(files / "hf"))
  reference.chat_template = CHATML
  shortest = min(len(reference.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True)
                     ["input_ids"]) for p in pairs)  # fmt: skip
  assert shortest > 64

  def cfg(*extra):
    return config("use_dpo=true", "use_chat_template=true", "dataset_type=hf", "hf_path=json",
                  f"hf_train_files={tmp_path}/pairs.jsonl", f"tokenizer_path={files}/hf/tokenizer.json",
                  "tokenizer_type=huggingface", "vocab_size=512", "override_model_config=true",
                  "train_data_columns=['prompt','chosen','rejected']", "per_device_batch_size=2", *extra)  # fmt: skip

  want = (
    f"no record of hf_train_files={tmp_path}/pairs.jsonl fits max_target_length=64; the shortest needs {shortest} tokens"
  )
  for check in (True, False):
    with pytest.raises(ConfigError, match=re.escape(want)):
      _first_batch_or_error(cfg(), check=check)
  with pytest.raises(ConfigError, match=f"fits max_target_length={shortest - 1};"):
    _first_batch_or_error(cfg(f"max_target_length={shortest - 1}"))
  batch = _first_batch_or_error(cfg(f"max_target_length={shortest}"))
  assert all(np.asarray(batch[f"{side}_targets_segmentation"]).any() for side in ("chosen", "rejected"))


@pytest.mark.parametrize(
  "pair, message",
  [
    ({"prompt": "a", "chosen": None, "rejected": "b"}, "column 'chosen' is null, not a string or a list of turns"),
    ({"prompt": 7, "chosen": "a", "rejected": "b"}, "column 'prompt' is 7, not a string or a list of turns"),
    ({"prompt": "a", "chosen": "b", "rejected": {"x": 1}}, "column 'rejected' is {\"x\": 1}, not a string or a list"),
  ],
)
def test_pair_columns_of_another_type_name_the_column(files, pair, message):  # noqa: F811
  with pytest.raises(ConfigError, match=re.escape(message)):
    _preference(files, CHATML)(pair)

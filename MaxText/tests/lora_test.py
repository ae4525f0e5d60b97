"""LoRA: fresh adapters keep the base model, merged weights equal the adapters, only adapters train, PEFT."""

import json
import os

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from MaxText import lora, optimizers
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.layers import decoders, models
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import config, train_batch

LORA = ("lora_rank=4", "lora_alpha=8")


def _init(cfg, seed=0):
  model = models.Transformer(cfg)
  boxed = model.init({"params": jax.random.key(seed)}, *models.init_inputs(1, cfg.max_target_length))["params"]
  return model, nn.meta.unbox(boxed)


def _logits(cfg, params, batch):
  model = models.Transformer(cfg)
  out, _ = model.apply(
    {"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"], deterministic=True,
    mutable=["intermediates"],
  )  # fmt: skip
  return np.asarray(out)


def _random_adapters(params, seed=1):
  """The params with every lora_b random too (a trained adapter)."""
  flat = traverse_util.flatten_dict(params)
  rng = np.random.default_rng(seed)
  return traverse_util.unflatten_dict(
    {k: rng.normal(0, 0.05, v.shape).astype(v.dtype) if k[-1] == "lora_b" else v for k, v in flat.items()}
  )


@pytest.mark.parametrize(
  "extra",
  [(), ("fused_qkv=true", "fused_mlp=true", "base_num_kv_heads=4", "override_model_config=true"), ("scan_layers=false",)],
)
def test_fresh_adapters_leave_the_base_model_bit_for_bit(extra):
  cfg = config(*LORA, *extra)
  _, params = _init(cfg)
  adapters, base = lora.partition(params)
  names = {"/".join(k[-2:]) for k in traverse_util.flatten_dict(adapters)}
  assert names == {f"{m}/lora_{x}" for m in ("query", "key", "value", "out", "wi_0", "wi_1", "wo") for x in "ab"}
  assert all(not np.any(b) for k, b in traverse_util.flatten_dict(adapters).items() if k[-1] == "lora_b")
  batch = train_batch(cfg)
  np.testing.assert_array_equal(_logits(cfg, params, batch), _logits(config(*extra), base, batch))


@pytest.mark.parametrize(
  "extra",
  [(), ("scan_layers=false",), ("fused_qkv=true", "fused_mlp=true", "base_num_kv_heads=4", "override_model_config=true")],
)
def test_merged_weights_equal_the_adapters(extra):
  cfg = config(*LORA, *extra, "lora_target_modules=['q_proj','value','out','wi_1','down_proj']")
  _, params = _init(cfg)
  params = _random_adapters(params)
  batch = train_batch(cfg)
  on = _logits(cfg, params, batch)
  merged = lora.merge(params, cfg)
  assert not any(lora.is_adapter(k) for k in traverse_util.flatten_dict(merged))
  base = lora.partition(params)[1]
  assert np.abs(on - _logits(config(*extra), base, batch)).max() > 1e-3, "the adapters must change the logits"
  np.testing.assert_allclose(_logits(config(*extra), merged, batch), on, rtol=1e-5, atol=1e-5)
  # A by hand: the query kernel of layer 0 plus alpha/r A B.
  path = ("layers", "self_attention", "query") if cfg.scan_layers else ("layers_0", "self_attention", "query")
  module = traverse_util.flatten_dict(params, sep="/")
  a, b, w = (np.asarray(module["/".join(path) + f"/{n}"], np.float64) for n in ("lora_a", "lora_b", "kernel"))
  if cfg.scan_layers:
    a, b, w = a[0], b[0], w[0]
  want = w + 2.0 * np.einsum("er,rhd->ehd", a, b)
  got = np.asarray(traverse_util.flatten_dict(merged, sep="/")["/".join(path) + "/kernel"])
  np.testing.assert_allclose(got[0] if cfg.scan_layers else got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "adafactor"])
def test_only_the_adapters_train_and_the_optimizer_holds_only_them(optimizer):
  cfg = config(*LORA, "learning_rate=1e-2", "steps=4", f"opt_type={optimizer}")
  mesh, model, schedule, tx, layout = step_lib.build(cfg, jax.devices()[:1])
  state = state_lib.init_state(model, cfg, tx, layout)
  adapters, base = lora.partition(state.params)
  n_adapters = len(jax.tree.leaves(adapters))
  assert n_adapters == 14
  if optimizer == "adamw":  # Adam's mu and nu (not the counts)
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert moments == sorted(2 * [x.shape for x in jax.tree.leaves(adapters)])
  full_cfg = config("learning_rate=1e-2", "steps=4", f"opt_type={optimizer}")
  _, _, _, full_tx, full_layout = step_lib.build(full_cfg, jax.devices()[:1])
  lora_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(layout.abstract.opt_state))
  full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(full_layout.abstract.opt_state))
  assert lora_bytes < full_bytes / 3

  step = jax.jit(lambda s, b: step_lib.train_step(model, cfg, tx, schedule, s, b))
  losses = []
  for i in range(4):
    state, metrics = step(state, train_batch(cfg, rows=2, seed=i))
    losses.append(float(metrics["learning/loss"]))
  new_adapters, new_base = lora.partition(state.params)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), new_base, base)
  changed = [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(new_adapters), jax.tree.leaves(adapters), strict=True)]
  assert all(changed)


def test_lora_training_equals_training_the_merged_low_rank_update():
  """One SGD step on the adapters equals differentiating the loss of W + s A B by hand (jax.grad of the merged
  model with respect to A and B, another code path)."""
  cfg = config(
    *LORA, "opt_type=sgd", "learning_rate=0.5", "warmup_steps_fraction=0", "gradient_clipping_threshold=0", "steps=1"
  )
  mesh, model, schedule, tx, layout = step_lib.build(cfg, jax.devices()[:1])
  state = state_lib.init_state(model, cfg, tx, layout)
  state = state.replace(params=_random_adapters(jax.device_get(state.params)))
  batch = train_batch(cfg, rows=2)
  new_state, _ = jax.jit(lambda s, b: step_lib.train_step(model, cfg, tx, schedule, s, b))(state, batch)
  plain_cfg = config("opt_type=sgd")
  plain = models.Transformer(plain_cfg)
  adapters, base = lora.partition(state.params)

  def merged_loss(adapters):
    params = lora.merge(lora.combine(adapters, base), cfg)
    loss, aux = lm_lib.loss_fn(plain, params, batch, jax.random.key(0), deterministic=True)
    return loss / aux["tokens"]

  grads = jax.grad(merged_loss)(adapters)
  lr = float(optimizers.learning_rate_schedule(cfg)(0))
  want = jax.tree.map(lambda p, g: p - lr * g, adapters, grads)
  got = lora.partition(new_state.params)[0]
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize(
  "change, message",
  [
    ("lora_rank=-1", "lora_rank=-1 is negative"),
    ("lora_rank=8", "lora_rank=8 is not below the model's smallest projection width .8."),
    ("lora_target_modules=['qkv']", "qkv is not a projection with adapters"),
    ("lora_alpha=0", "lora_alpha=0.0 must be > 0"),
  ],
)
def test_bad_lora_keys_are_config_errors(change, message):
  with pytest.raises(ConfigError, match=message):
    config("lora_rank=4", change)
  with pytest.raises(ConfigError, match="hf_lora_adapter_path is set but lora_rank=0"):
    config("hf_lora_adapter_path=/tmp/x")
  with pytest.raises(ConfigError, match="hf_lora_export=adapter exports a LoRA checkpoint's adapters"):
    config("hf_lora_export=adapter")


@pytest.mark.parametrize("targets, named", [("['qkv']", "qkv"), ("['query','q_prj']", "q_prj"), ("[]", "empty")])
def test_target_modules_naming_nothing_are_refused_with_lora_off_too(targets, named):
  """Before: accepted with lora_rank=0, and refused only once LoRA was turned on."""
  for rank in ("lora_rank=0", "lora_rank=4"):
    with pytest.raises(ConfigError, match=rf"^lora_target_modules=.*: {named} is not a projection with adapters"):
      config(rank, f"lora_target_modules={targets}")
  assert config("lora_target_modules=['q_proj','wo']").lora_target_modules == ("q_proj", "wo")


def test_dpo_under_lora_refuses_to_start_from_trained_adapters(tmp_path):
  """Its reference would be the base, not the starting policy: refused by the objective's checks at the start."""
  from MaxText import objectives

  cfg = config(*LORA, "use_dpo=true", "dataset_type=hf", f"hf_lora_adapter_path={tmp_path}")
  with pytest.raises(ConfigError, match="objective=dpo under LoRA compares with the base model"):
    objectives.get(cfg).check_start()


def test_target_modules_that_name_no_projection_are_refused():
  cfg = config("model_name=deepseek3-tiny", "lora_rank=2", "lora_target_modules=['query','out']")
  with pytest.raises(ConfigError, match="names no projection of decoder_block=deepseek"):
    step_lib.build(cfg, jax.devices()[:1])


@pytest.mark.slow  # PEFT's own loading (torch); the merged-weights and merged-training equalities are its fast siblings.
@pytest.mark.parametrize("family, scan", [("llama", "true"), ("qwen3", "false")])
def test_peft_adapter_round_trip_through_transformers(family, scan, tmp_path):
  """A LoRA checkpoint exports as a PEFT folder that peft.PeftModel.from_pretrained loads on our exported base with
  our logits; the merged export loads in transformers with them too; hf_lora_adapter_path reads the folder back bit
  for bit."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft_lib = pytest.importorskip("peft")
  from MaxText import checkpointing, convert_to_hf_checkpoint, families
  from MaxText.convert import peft
  from MaxText.tests import hf_checkpoint_test as hf

  hf.save_random(family, str(tmp_path / "hf"))
  ckpt = hf.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"), scan)
  lora_keys = (
    "lora_rank=4",
    "lora_alpha=16",
    "lora_target_modules=['q_proj','k_proj','value','o_proj','wi_0','up_proj','wo']",
  )
  base_cfg = hf.our_config(ckpt, scan=scan)
  cfg = hf.our_config(ckpt, *lora_keys, scan=scan)
  mesh, base = hf.restore(base_cfg)
  _, fresh = _init(cfg, seed=3)
  params = lora.combine(lora.partition(_random_adapters(fresh, seed=4))[0], jax.device_get(base))
  items = checkpointing.save_params(str(tmp_path / "lora/checkpoints"), params)

  def export(target, *extra):
    keys = [k for k in hf._keys(cfg) if not k.startswith("load_parameters_path=")]
    argv = ["export", hf.BASE_YML, *keys, f"load_parameters_path={items}", f"hf_model_path={target}", *extra]
    return convert_to_hf_checkpoint.main(argv)

  assert export(tmp_path / "base", *lora_keys, "hf_lora_export=base") == 0
  assert export(tmp_path / "adapter", *lora_keys, "hf_lora_export=adapter") == 0
  assert export(tmp_path / "merged", *lora_keys, "hf_lora_export=merged") == 0
  assert export(tmp_path / "refused", "lora_rank=0") == 2  # the base alone only with hf_lora_export=base
  assert not (tmp_path / "refused").exists()
  settings = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
  assert settings["r"] == 4 and settings["lora_alpha"] == 16 and len(settings["target_modules"]) == 7 * 3

  tokens, valid = hf.padded_batch([24, 13, 7], cfg.vocab_size)
  ours = hf.our_logits(cfg, mesh, params, tokens, valid)
  assert np.abs(ours - hf.our_logits(base_cfg, mesh, base, tokens, valid)).max() > 1e-2, "the adapters must matter"
  with torch.no_grad():
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    peft_model = peft_lib.PeftModel.from_pretrained(base_model, str(tmp_path / "adapter")).eval()
  hf.assert_close(ours, hf.hf_logits(peft_model, tokens, valid), valid)
  merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
  hf.assert_close(ours, hf.hf_logits(merged, tokens, valid), valid)

  # A run started from the base with hf_lora_adapter_path holds the adapters bit for bit, placed as its layout says.
  base_items = checkpointing.save_params(str(tmp_path / "base_ckpt/checkpoints"), jax.device_get(base))
  start_cfg = cfg.replace(load_parameters_path=base_items, hf_lora_adapter_path=str(tmp_path / "adapter"))
  _, model, _, tx, layout = step_lib.build(start_cfg, jax.devices()[:1])
  start = checkpointing.restore_or_init(start_cfg, None, model, tx, layout)
  assert "adapters from" in start.source
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(start.state.params), jax.device_get(params))

  abstract = lora.partition(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))[0]
  where = lambda p, i: decoders.param_path(cfg, p, i)  # noqa: E731
  read = peft.read_adapter(str(tmp_path / "adapter"), cfg, families.hf_mapping(cfg), abstract, where)
  jax.tree.map(np.testing.assert_array_equal, read, jax.tree.map(np.asarray, lora.partition(params)[0]))
  with pytest.raises(ConfigError, match="has r=4 but lora_rank=8; set lora_rank=4"):
    peft.read_adapter(str(tmp_path / "adapter"), cfg.replace(lora_rank=8), families.hf_mapping(cfg), abstract, where)
  fewer = cfg.replace(lora_target_modules=("query", "key", "value", "out", "wi_0", "wi_1"))
  with pytest.raises(ConfigError, match=r"down_proj.lora_A.weight \(and 5 more\) that lora_target_modules"):
    peft.read_adapter(str(tmp_path / "adapter"), fewer, families.hf_mapping(cfg), lora.partition(_init(fewer)[1])[0], where)


@pytest.mark.slow
def test_lora_from_a_base_checkpoint_resumes_exactly_and_decodes_merged_or_not(tmp_path):
  """train.py: a base run, then LoRA from its params (fresh adapters), stopped and resumed with the uninterrupted
  run's losses; decode.py with the adapters on equals decode.py on the merged params-only checkpoint."""
  import re
  import sys

  import tokenizers
  from tokenizers import models as tok_models
  from tokenizers import pre_tokenizers, trainers

  from MaxText.tests.helpers import BASE_YML, metrics_losses, run
  from MaxText.tests.helpers import overrides as overrides_of
  from MaxText.tests.sft_test import WORDS

  tok = tokenizers.Tokenizer(tok_models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(
    [WORDS] * 5, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  )
  tok.save(str(tmp_path / "tokenizer.json"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  common = ("vocab_size=512", "override_model_config=true", f"base_output_directory={tmp_path}/out", "steps=8")
  common += ("enable_checkpointing=true", "checkpoint_period=4", "learning_rate_schedule_steps=8", "learning_rate=1e-2")

  def train(*args):
    proc = run([sys.executable, "MaxText/train.py", BASE_YML, *overrides_of(*common, *args)], env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout

  train("run_name=base", "steps=4")
  lora_keys = ("lora_rank=4", "lora_alpha=8", f"load_parameters_path={tmp_path}/out/base/checkpoints/4/items")
  out = train("run_name=a", f"metrics_file={tmp_path}/a.jsonl", *lora_keys)
  assert "fresh LoRA adapters (rank 4)" in out
  train("run_name=b", f"metrics_file={tmp_path}/b.jsonl", "steps=4", *lora_keys)
  assert "resumed from" in train("run_name=b", f"metrics_file={tmp_path}/b.jsonl", *lora_keys)
  assert metrics_losses(tmp_path / "b.jsonl") == metrics_losses(tmp_path / "a.jsonl")

  proc = run([sys.executable, "MaxText/generate_param_only_checkpoint.py", BASE_YML, *overrides_of(
    *common, "run_name=merged", f"load_full_state_path={tmp_path}/out/a/checkpoints/8/items", "lora_rank=4", "lora_alpha=8",
  )], env)  # fmt: skip
  assert proc.returncode == 0, proc.stderr
  decode = ("tokenizer_type=huggingface", f"tokenizer_path={tmp_path}/tokenizer.json", "add_bos=false", "add_eos=false",
            "prompt=Which book", "max_prefill_predict_length=8", "per_device_batch_size=1",
            "decode_sampling_strategy=greedy")  # fmt: skip
  outputs = []
  for keys in (
    ("lora_rank=4", "lora_alpha=8", f"load_parameters_path={tmp_path}/out/a/checkpoints/8/items"),
    (f"load_parameters_path={tmp_path}/out/merged/checkpoints/0/items",),
  ):
    proc = run([sys.executable, "MaxText/decode.py", BASE_YML, *overrides_of(*common, *decode, *keys, "run_name=d")], env)
    assert proc.returncode == 0, proc.stderr
    outputs.append(re.findall(r"-> `(.*)`", proc.stdout, re.S))
  assert outputs[0] == outputs[1] and outputs[0][0]

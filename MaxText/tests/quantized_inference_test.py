"""Weight-only quantized inference (quantization=int8w / int4w) and quantized params checkpoints, on a model that
has learnt something: the tiny Llama widened a little and trained 400 steps on the demo corpus (eval loss about 4.6
against ln(1024) = 6.93 for a uniform guess; ~10 s), so greedy agreement and perplexity mean something.

- int8w decodes the float model's greedy tokens on most prompts, int4w per group on fewer (stated thresholds);
- int8w's perplexity on the demo validation split is within 1% of the float model's (the model's forward pass);
- quantized training values (int8, fp8_full) decode through qwix's QT model with the train step's numerics;
- a quantized params checkpoint round-trips bit for bit, and decodes the same text;
- 8 devices (fsdp x tensor) decode as one; the quantized weights are laid out like the float ones;
- a checkpoint loaded as what it is not, a mismatched group size, a group that does not divide: exit 2, one line.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import checkpointing, decode, input_pipeline, sharding, train
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.layers import models, quantizations
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import BASE_YML, assert_trees_equal, config, overrides

DEMO = os.path.expanduser("~/maxtext_data/demo")
MODEL = (
  "vocab_size=1024",
  "override_model_config=true",
  "base_emb_dim=64",
  "base_mlp_dim=256",
  "head_dim=16",
  f"tokenizer_path={DEMO}/tokenizer.model",
  "dataset_type=grain",
  f"grain_train_files={DEMO}/array_record/train/*",
  f"grain_eval_files={DEMO}/array_record/validation/*",
)
DECODE = ("max_target_length=32", "max_prefill_predict_length=16")
PROMPT_TOKENS = 16
EVAL_BATCHES = 25  # 25 x 8 rows x 64 tokens of the validation split: 12,800 tokens


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(root, the checkpoint's items path, its float params on one device, validation batches of 8 x 64 tokens)."""
  if not os.path.isfile(os.path.join(DEMO, "tokenizer.model")):
    pytest.fail(f"the demo corpus is missing from {DEMO}; bash setup.sh builds it")
  root = tmp_path_factory.mktemp("quantized")
  run = (*MODEL, f"base_output_directory={root}", "run_name=float", "enable_checkpointing=true", "steps=400")
  train.train(
    config(
      *run,
      "learning_rate=3e-3",
      "per_device_batch_size=8",
      "checkpoint_period=400",
      "async_checkpointing=false",
      "log_period=100",
    ),
    devices=jax.devices()[:1],
  )
  items = str(root / "float" / "checkpoints" / "400" / "items")
  cfg = config(*MODEL, *DECODE, f"load_parameters_path={items}", "per_device_batch_size=8")
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  params, _ = checkpointing.load_params(cfg, mesh, jnp.float32)
  evaluation = config(*MODEL, "per_device_batch_size=8", "max_target_length=64")
  batches = []
  for batch in input_pipeline.create_eval_iterator(evaluation, sharding.create_mesh(evaluation, jax.devices()[:1])):
    batches.append(jax.device_get(batch))
    if len(batches) == EVAL_BATCHES:
      break
  return root, items, params, batches


def _prompts(batches, n: int) -> list[tuple[int, ...]]:
  """The first PROMPT_TOKENS tokens of validation rows that start with PROMPT_TOKENS real (unpadded) tokens."""
  rows = [
    tuple(int(t) for t in b["inputs"][r, :PROMPT_TOKENS])
    for b in batches
    for r in range(b["inputs"].shape[0])
    if b["inputs_segmentation"][r, :PROMPT_TOKENS].all()
  ]
  return rows[:n]


def _decode_config(*extra, devices=1, **kw):
  return config(*MODEL, *DECODE, f"per_device_batch_size={8 // devices}", *extra, num_devices=devices, **kw)


def _engine(cfg, params, devices=1):
  return engine_lib.Engine(cfg, sharding.create_mesh(cfg, jax.devices()[:devices]), params)


def _greedy(engine, prompts, **settings):
  n = engine.config.max_target_length - engine.config.max_prefill_predict_length
  return engine.generate([engine_lib.Request(p, n, **settings) for p in prompts])


def _agreement(got, want) -> float:
  """The fraction of prompts whose whole greedy continuation is the reference's."""
  return float(np.mean([a.tokens == b.tokens for a, b in zip(got, want, strict=True)]))


# A whole continuation of 16 greedy tokens must match. int8 weights (per output channel, 255 levels) move a logit by
# a fraction of a percent, so only near-ties can flip: 48 of the 48 prompts match (measured 2026-11-27). int4 per
# group of 16 (15 levels) moves them about 16 times more: 45 of 48. The thresholds leave a margin below those.
INT8_AGREEMENT = 0.9
INT4_AGREEMENT = 0.75


@pytest.mark.parametrize(
  "extra, threshold",
  [
    (("quantization=int8w",), INT8_AGREEMENT),
    # (int4 is decoded in the quick loop by the checkpoint round trip; its agreement is measured here)
    pytest.param(("quantization=int4w", "quantization_group_size=16"), INT4_AGREEMENT, marks=pytest.mark.slow),
  ],
  ids=["int8w", "int4w_group16"],
)
def test_weight_only_decode_gives_the_float_models_greedy_tokens_on_most_prompts(trained, extra, threshold):
  _, _, params, batches = trained
  prompts = _prompts(batches, 48)
  assert len(prompts) == 48
  want = _greedy(_engine(_decode_config(), params), prompts)
  quantized = _engine(_decode_config(*extra), params)
  assert quantizations.is_quantized(quantized.params)
  got = _greedy(quantized, prompts)
  agreement = _agreement(got, want)
  print(f"{extra}: {agreement:.3f} of {len(prompts)} prompts give the float model's 16 greedy tokens")
  assert agreement >= threshold
  # Not one continuation for all: greedy text of a model this small falls into a few loops ("and the LORD, and the
  # LORD"), but from different points of them (20 distinct continuations of the 48, measured).
  assert len({tuple(r.tokens) for r in want}) >= len(prompts) // 3


def _perplexity(cfg, params, batches) -> float:
  """exp(mean cross-entropy per target token) of the model of `cfg` (quantized as it says) over `batches`."""
  model = quantizations.quantize_model(models.Transformer(cfg), cfg)
  loss = jax.jit(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[1])
  total, tokens = 0.0, 0
  for batch in batches:
    aux = loss(params, batch)
    total, tokens = total + float(aux["xent"]), tokens + int(aux["tokens"])
  return math.exp(total / tokens)


def test_weight_only_int8_perplexity_is_within_one_percent_of_float(trained):
  """On 12,800 tokens of the demo validation split, through the model's forward pass (the training loss)."""
  _, _, params, batches = trained
  evaluation = ("per_device_batch_size=8", "max_target_length=64")
  plain = _perplexity(config(*MODEL, *evaluation), params, batches)
  figures = {"float": plain}
  for name, extra in {
    "int8w": ("quantization=int8w",),
    "int4w/16": ("quantization=int4w", "quantization_group_size=16"),
  }.items():
    cfg = config(*MODEL, *evaluation, *extra)
    quantized = engine_lib.serving_params(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), params)
    figures[name] = _perplexity(cfg, quantized, batches)
  print("perplexity: " + ", ".join(f"{k} {v:.5f}" for k, v in figures.items()))
  assert plain < 200  # far below the 1024 of a uniform guess: the check is on a model that has learnt something
  assert abs(figures["int8w"] / plain - 1) < 0.01
  assert figures["int8w"] != plain  # the weights were quantized


@pytest.mark.parametrize("name", ["int8", pytest.param("fp8_full", marks=pytest.mark.slow)])
def test_quantized_training_values_decode_with_the_train_steps_numerics(trained, name):
  """The engine's prompt logprobs (echo) under quantization=int8 / fp8_full equal those of the training model's
  forward pass (qwix QT on the float params) on the same tokens, and differ from the float model's."""
  _, _, params, batches = trained
  prompt = _prompts(batches, 1)[0]
  cfg = _decode_config(f"quantization={name}")
  engine = _engine(cfg, params)
  echoed = engine.generate([engine_lib.Request(prompt, 1, logprobs=0, echo=True)])[0].prompt_logprobs[1:]
  got = np.asarray([x.logprob for x in echoed])

  def forward_logprobs(model):
    tokens = jnp.asarray([prompt], jnp.int32)
    logits = model.apply({"params": params}, tokens, jnp.ones_like(tokens), jnp.arange(len(prompt))[None])
    lp = jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(lp, tokens[0, 1:, None], axis=-1)[:, 0])

  training = step_lib.build(cfg, jax.devices()[:1]).model
  np.testing.assert_allclose(got, forward_logprobs(training), atol=2e-4)
  assert np.max(np.abs(got - forward_logprobs(models.Transformer(cfg)))) > 1e-3


@pytest.mark.mesh
def test_sharded_weight_only_decode_equals_one_device(trained):
  """int8w on fsdp=4 x tensor=2: the same tokens and logprobs as one device; each quantized value is split like its
  float weight, and its scale along the output channels only."""
  from MaxText.tests.helpers import assert_sharded_decode_equals_one_device

  _, _, params, batches = trained
  one = _decode_config("quantization=int8w")
  eight = _decode_config("quantization=int8w", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", devices=8)
  engine8 = assert_sharded_decode_equals_one_device(one, eight, params, _prompts(batches, 8))
  kernel = engine8.params["layers"]["mlp"]["wi_0"]["kernel"].array
  float_spec = sharding.logical_to_mesh_spec(("layers", "embed", "mlp"), eight)
  assert kernel.qvalue.sharding.spec == float_spec and kernel.qvalue.dtype == jnp.int8
  assert tuple(kernel.scale.sharding.spec) == (float_spec[0], None, float_spec[2]) and kernel.scale.shape[1] == 1


# ------------------------------------------------------------------------------------------ checkpoints and the CLI
def _run(args, capsys):
  code = decode.main(["decode", BASE_YML, *overrides(*MODEL, *DECODE, "per_device_batch_size=1", *args)])
  out, err = capsys.readouterr()
  return code, out, err


def _outputs(out: str) -> list[str]:
  return [line for line in out.splitlines() if line.startswith("Input `")]


def test_quantized_params_checkpoint_round_trips(trained, tmp_path, capsys):
  """decode.py with save_quantized_params_path writes the int4w params; loaded with checkpoint_is_quantized they
  equal the ones quantized from the float checkpoint bit for bit and decode the same text (never overwritten)."""
  _, items, params, _ = trained
  quant = ("quantization=int4w", "quantization_group_size=16")
  saved = tmp_path / "int4w"
  code, out, err = _run((*quant, f"load_parameters_path={items}", f"save_quantized_params_path={saved}"), capsys)
  assert code == 0, err
  assert "Input `" not in out  # it saves, and decodes nothing
  loaded_cfg = _decode_config(*quant, "checkpoint_is_quantized=true", f"load_parameters_path={saved}/0/items")
  mesh = sharding.create_mesh(loaded_cfg, jax.devices()[:1])
  loaded, _ = checkpointing.load_params(loaded_cfg, mesh, jnp.float32)
  before = engine_lib.serving_params(loaded_cfg, mesh, params)
  assert_trees_equal(engine_lib.serving_params(loaded_cfg, mesh, loaded), before)
  kernel = loaded["layers"]["mlp"]["wo"]["kernel"].array
  assert kernel.qvalue.dtype == jnp.int4 and kernel.scale.shape[1] == 256 // 16  # restored as int4, 16 groups

  prompt = ("prompt=And God said",)
  code, from_float, err = _run((*quant, f"load_parameters_path={items}", *prompt), capsys)
  assert code == 0, err
  code, from_saved, err = _run(
    (*quant, "checkpoint_is_quantized=true", f"load_parameters_path={saved}/0/items", *prompt), capsys
  )
  assert code == 0, err
  assert _outputs(from_saved) == _outputs(from_float) and len(_outputs(from_float)) == 1

  code, _, err = _run((*quant, f"load_parameters_path={items}", f"save_quantized_params_path={saved}"), capsys)
  assert code == 2 and f"save_quantized_params_path={saved} already holds a checkpoint" in err


@pytest.mark.parametrize(
  "extra, message",
  [
    (("quantization=int8w", "load_parameters_path={saved}"), "checkpoint_is_quantized=false but load_parameters_path="),
    (("load_parameters_path={saved}",), "checkpoint_is_quantized=false but load_parameters_path="),
    (
      ("quantization=int4w", "checkpoint_is_quantized=true", "load_parameters_path={saved}"),
      "quantization=int4w but load_parameters_path=",
    ),
    (
      ("quantization=int8w", "quantization_group_size=16", "checkpoint_is_quantized=true", "load_parameters_path={saved}"),
      "quantization_group_size=16 but load_parameters_path=",
    ),
    (
      ("quantization=int8w", "checkpoint_is_quantized=true", "load_parameters_path={items}"),
      "checkpoint_is_quantized=true but load_parameters_path=",
    ),
    (
      ("quantization=int8w", "quantization_group_size=24", "load_parameters_path={items}"),
      "quantization_group_size=24 does not divide",
    ),
    (
      (
        "quantization=int8w",
        "quantization_group_size=24",
        "load_parameters_path={items}",
        "save_quantized_params_path={new}",
      ),
      "quantization_group_size=24 does not divide",
    ),
  ],
  ids=["int8w_unflagged", "float_unflagged", "other_quantization", "other_group", "float_flagged", "group", "group_save"],
)
def test_a_checkpoint_loaded_as_what_it_is_not_is_one_line_and_exit_2(trained, tmp_path_factory, capsys, extra, message):
  root, items, _, _ = trained
  saved = root / "int8w"
  if not saved.exists():  # written once for the cases
    assert (
      _run(("quantization=int8w", f"load_parameters_path={items}", f"save_quantized_params_path={saved}"), capsys)[0] == 0
    )
  new = tmp_path_factory.mktemp("new") / "q"
  args = [e.format(saved=f"{saved}/0/items", items=items, new=new) for e in extra]
  code, out, err = _run((*args, "prompt=And God said"), capsys)
  assert code == 2, err
  assert message in err and len(err.strip().splitlines()) == 1, err
  assert "Input `" not in out and not new.exists()


def test_a_bfloat16_hugging_face_import_decodes_with_int8_weights(tmp_path):
  """convert_hf_checkpoint.py keeps writing the float (here bfloat16) checkpoint; int8w quantizes it as it loads:
  the prompt logprobs stay within int8's error of the bfloat16 model's, and the checkpoint is not taken for a
  quantized one."""
  hf = pytest.importorskip("MaxText.tests.hf_checkpoint_test")
  hf_dir = str(tmp_path / "hf")
  hf.save_random("llama", hf_dir).to(hf.torch.bfloat16).save_pretrained(hf_dir)
  ckpt = hf.import_hf(hf_dir, str(tmp_path / "out"), scan="true")
  items = os.path.join(ckpt, "items")
  float_cfg = hf.our_config(ckpt, "weight_dtype=bfloat16")
  mesh, params = hf.restore(float_cfg)
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  int8_cfg = hf.our_config(ckpt, "weight_dtype=bfloat16", "quantization=int8w")
  prompt = tuple(int(t) for t in np.random.default_rng(0).integers(1, float_cfg.vocab_size, 16))
  request = engine_lib.Request(prompt, 1, logprobs=0, echo=True)
  want, got = (
    np.asarray([x.logprob for x in engine_lib.Engine(cfg, mesh, params).generate([request])[0].prompt_logprobs[1:]])
    for cfg in (float_cfg, int8_cfg)
  )
  print(f"int8w against bfloat16 weights: max |logprob difference| {np.max(np.abs(got - want)):.4f}")
  # Measured 0.021 (2026-11-27): per-channel int8 moves each weight by at most 1/254 of its channel's largest; the
  # bound leaves 5x, and stays far below the logprobs themselves (about -4.6 for this 96-token vocabulary).
  assert 0 < np.max(np.abs(got - want)) <= 0.1
  flagged = hf.our_config(ckpt, "weight_dtype=bfloat16", "quantization=int8w", "checkpoint_is_quantized=true")
  with pytest.raises(ConfigError, match=f"checkpoint_is_quantized=true but load_parameters_path={items} holds float"):
    checkpointing.load_params(flagged, mesh, jnp.float32)


def test_a_multi_head_latent_attention_model_decodes_with_int8_weights():
  """DeepSeek's MLA reads wkv_b whole in a decode step (folded into the query and the output), which a quantized
  weight cannot be: it stays float, its other projections are quantized, and the cached steps give the tokens of
  recomputing each prefix in the prefill mode (the engine's first-chunk path) on the same quantized weights."""
  from flax import linen as nn

  cfg = config("model_name=deepseek3-tiny", "max_target_length=24", "max_prefill_predict_length=16", "quantization=int8w")
  float_params = nn.meta.unbox(models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8))["params"])
  engine = _engine(cfg, float_params)
  for stack in ("dense_layers", "moe_layers"):
    attention = engine.params[stack]["self_attention"]
    assert not quantizations.is_quantized(attention["wkv_b"]) and quantizations.is_quantized(attention["wkv_a"])
  prompt = tuple(int(t) for t in np.random.default_rng(0).integers(1, cfg.vocab_size, 6))
  cached = _greedy(engine, [prompt])[0].tokens
  recomputed = list(prompt)
  for _ in range(len(cached)):  # each next token from a prefill of the whole prefix
    recomputed += engine.generate([engine_lib.Request(tuple(recomputed), 1)])[0].tokens
  assert cached == recomputed[len(prompt) :]


# ---------------------------------------------------------------------------------------- a mixture of experts' experts
# A tiny Mixtral (4 experts, top-2, no shared expert): its routed experts' kernels are parameters of the MoE block
# (mlp/wi_0, wi_1, wo, [experts, in, out] per layer) that another module multiplies by, which PTQ cannot find alone.
MOE = (
  "decoder_block=mixtral",
  "override_model_config=true",
  "num_experts=4",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=48",
  "max_target_length=16",
  "max_prefill_predict_length=8",
)
EXPERT_KERNELS = ("wi_0", "wi_1", "wo")


def _moe_float_params(cfg):
  from flax import linen as nn

  return nn.meta.unbox(models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8))["params"])


def _absmax_int8(w: np.ndarray, served: np.ndarray) -> np.ndarray:
  """The int8 quantize-dequantize of stacked expert kernels w [layers, experts, in, out] by NumPy: one scale per
  layer, expert and output channel, max |w| over the inputs / 127.5 (qwix's int8 bound, the middle of the top
  bucket), the values w / scale rounded half to even and clipped to [-128, 127], times their scale. A channel's
  largest |w| lands on the bucket edge 127.5 itself, where the last bit of a float32 quotient picks the bucket
  (-127.5 gives -128 or -127): there either is right, so the `served` integers must be one of the two and are taken."""
  scale = (np.max(np.abs(w), axis=2, keepdims=True) / np.float32(127.5)).astype(np.float32)
  quotient = w.astype(np.float64) / scale
  values = np.clip(np.round(quotient), -128, 127)
  edge = np.abs(np.abs(quotient) - 127.5) < 1e-4
  assert np.all((served == values) | (edge & (np.abs(served - quotient) <= 0.5 + 1e-4)))
  assert edge.sum() <= w.size // w.shape[2]  # at most the largest of each channel
  return (np.where(edge, served, values) * scale).astype(np.float32)


def test_weight_only_quantizes_the_routed_experts_per_expert_and_output_channel():
  """int8w with moe in quantization_targets: the routed experts' kernels are served as int8 values with a scale per
  layer, expert and output channel ([layers, experts, 1, out]; per group of inputs with quantization_group_size), the
  float tree keeping its paths; the logits are the float model's on the NumPy-dequantized kernels, not its own."""
  cfg = config(*MOE, "quantization=int8w", "quantization_targets=[moe]")
  float_cfg = config(*MOE)
  params = _moe_float_params(float_cfg)
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  served = engine_lib.serving_params(cfg, mesh, params)
  for name in EXPERT_KERNELS:
    quantized = served["layers"]["mlp"][name].array
    layers, experts, _, out = params["layers"]["mlp"][name].shape
    assert quantized.qvalue.dtype == jnp.int8 and quantized.qvalue.shape == params["layers"]["mlp"][name].shape
    assert quantized.scale.shape == (layers, experts, 1, out)
  assert not quantizations.is_quantized(served["layers"]["mlp"]["gate"])  # the router stays float

  grouped = config(*MOE, "quantization=int4w", "quantization_group_size=16", "quantization_targets=[moe]")
  wo = engine_lib.serving_params(grouped, mesh, params)["layers"]["mlp"]["wo"].array
  assert wo.scale.shape == (2, 4, 48 // 16, cfg.emb_dim) and int(np.abs(np.asarray(wo.qvalue)).max()) <= 8

  tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 16)), jnp.int32)
  inputs = (tokens, jnp.ones_like(tokens), jnp.broadcast_to(jnp.arange(16), tokens.shape))
  got = quantizations.quantize_model(models.Transformer(cfg), cfg).apply({"params": served}, *inputs)
  dequantized = jax.tree_util.tree_map(np.asarray, params)
  for name in EXPERT_KERNELS:
    served_values = np.asarray(served["layers"]["mlp"][name].array.qvalue, np.float64)
    dequantized["layers"]["mlp"][name] = _absmax_int8(dequantized["layers"]["mlp"][name], served_values)
  want = models.Transformer(float_cfg).apply({"params": dequantized}, *inputs)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  plain = models.Transformer(float_cfg).apply({"params": params}, *inputs)
  assert np.max(np.abs(np.asarray(got) - np.asarray(plain))) > 1e-3


@pytest.mark.mesh
def test_weight_only_moe_decodes_on_expert_and_tensor_parallel_devices_as_on_one():
  """int8w of every target on an MoE model: 8 devices (expert x tensor) decode the tokens and logprobs of one; the
  experts' int8 values are split like their float kernels."""
  from MaxText.tests.helpers import assert_sharded_decode_equals_one_device

  one = config(*MOE, "quantization=int8w", "per_device_batch_size=8")
  eight = config(
    *MOE,
    "quantization=int8w",
    "per_device_batch_size=1",
    "ici_expert_parallelism=4",
    "ici_fsdp_parallelism=1",
    "ici_tensor_parallelism=2",
    num_devices=8,
  )
  params = _moe_float_params(config(*MOE))
  prompts = [tuple(int(t) for t in row) for row in np.random.default_rng(1).integers(1, one.vocab_size, (8, 6))]
  engine8 = assert_sharded_decode_equals_one_device(one, eight, params, prompts)
  wi = engine8.params["layers"]["mlp"]["wi_0"].array
  assert wi.qvalue.dtype == jnp.int8
  assert wi.qvalue.sharding.spec == sharding.logical_to_mesh_spec(("layers", "exp", "embed_no_exp", "mlp"), eight)


def test_a_quantized_moe_params_checkpoint_round_trips(tmp_path):
  """save_quantized_params of an MoE model's int8w params, loaded back with checkpoint_is_quantized: the same
  arrays bit for bit, the experts' int8 values and scales included."""
  cfg = config(*MOE, "quantization=int8w", f"save_quantized_params_path={tmp_path / 'q'}")
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  served = engine_lib.serving_params(cfg, mesh, _moe_float_params(config(*MOE)))
  items = checkpointing.save_quantized_params(cfg, served)
  loaded_cfg = config(*MOE, "quantization=int8w", "checkpoint_is_quantized=true", f"load_parameters_path={items}")
  loaded, _ = checkpointing.load_params(loaded_cfg, mesh, jnp.float32)
  assert quantizations.is_quantized(loaded["layers"]["mlp"]["wo"])
  assert_trees_equal(engine_lib.serving_params(loaded_cfg, mesh, loaded), served)

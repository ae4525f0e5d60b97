"""Quantized training (layers/quantizations.py, through qwix): a quantized matmul against a NumPy quantize-dequantize
reference, which matmuls each quantization_targets entry quantizes, sharded against one device, checkpoints shared
with unquantized runs, and the one-line refusals of bad input."""

import dataclasses
import os
import re
import sys
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn

from MaxText import sharding
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.layers import models, quantizations
from MaxText.layers.linears import DenseGeneral
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, overrides, run, train_batch

pytest.importorskip("qwix")

# A tiny Mixtral (4 experts, top-2) with one shared expert: attention, routed and shared experts, an untied head.
MOE = (
  "decoder_block=mixtral",
  "override_model_config=true",
  "num_experts=4",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=48",
  "shared_experts=1",
)

# The largest finite value of each quantized type; absmax calibration maps a channel's largest |x| to it (int8: the
# middle of the top bucket, 127.5, so that bucket is as wide as the others: qwix's numerics.get_symmetric_bound).
BOUND = {"int8": 127.5, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantize_dequantize(a: np.ndarray, qtype: str, reduce_axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """(quantized values as float32, scale) of float32 `a` with one absmax scale per slice over `reduce_axes`:
  scale = max|a| / BOUND (1 where that is below sqrt of float32's smallest normal), values = a / scale rounded half to
  even and clipped to [-128, 127] for int8, or clipped to the type's range and cast (round to nearest even) for fp8."""
  scale = np.max(np.abs(a), axis=reduce_axes, keepdims=True) / np.float32(BOUND[qtype])
  scale = np.where(scale < np.sqrt(np.finfo(np.float32).tiny), np.float32(1), scale).astype(np.float32)
  v = (a / scale).astype(np.float32)
  if qtype == "int8":
    return np.clip(np.round(v), -128, 127).astype(np.float32), scale
  fp8 = getattr(ml_dtypes, qtype)
  top = float(ml_dtypes.finfo(fp8).max)
  return np.clip(v, -top, top).astype(fp8).astype(np.float32), scale


def reference(x, w, g, fwd: str, bwd: str, per_tensor: bool):
  """y = x . w and the gradients of sum(y * g), quantized as qwix's QT does it (read in qwix 0.1.8,
  core/dot_general_qt.py):
    forward: x [M, K] one scale per row (over K), w [K, N] one per column (over K); y = (qx . qw) * sx * sw;
    dx = Q(g * sw) . qw^T, g * sw [M, N] quantized in the gradient type with one scale per row (over N), and the
      forward's quantized w reused (its scale moved onto g first);
    dw = qx^T . Q(g * sx), g * sx [M, N] quantized with one scale per column (over M), the forward's qx reused.
  per_tensor (qwix's disable_channelwise_axes): one scale for each whole operand instead."""
  every = (0, 1)
  qx, sx = quantize_dequantize(x, fwd, every if per_tensor else (1,))
  qw, sw = quantize_dequantize(w, fwd, every if per_tensor else (0,))
  y = (qx.astype(np.float64) @ qw) * sx * sw
  qg, sg = quantize_dequantize((g * sw.reshape(1, -1)).astype(np.float32), bwd, every if per_tensor else (1,))
  dx = (qg.astype(np.float64) * sg) @ qw.T
  qg, sg = quantize_dequantize((g * sx.reshape(-1, 1)).astype(np.float32), bwd, every if per_tensor else (0,))
  dw = qx.T.astype(np.float64) @ (qg * sg)
  return y, dx, dw


class Head(nn.Module):
  """One projection, at the output head's module path (the `head` target)."""

  config: object

  @nn.compact
  def __call__(self, x):
    return DenseGeneral((24,), ("embed", "vocab"), self.config, name="logits_dense")(x)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per_channel", "per_tensor"])
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_full"])
def test_quantized_matmul_forward_and_backward_equal_numpy_quantize_dequantize(name, per_tensor):
  """DenseGeneral under quantizations.training_rules (qwix QT) gives the forward and both gradients of `reference`.
  The scale axes, verified here for every operand: the forward's activation x [M, K] per row and weight w [K, N] per
  output column; dx's incoming gradient per row, times w's scale; dw's incoming gradient per column, times x's
  scale (with quantization_local_shard_count=1, one tile of the contraction axis). Tolerance: the same integers
  (or fp8 values) and scales, summed in another order in float32: 1e-5 of the largest entry."""
  import qwix

  cfg = config(f"quantization={name}", "quantization_targets=[head]", "quantization_local_shard_count=1")
  (rule,) = quantizations.training_rules(cfg)
  if per_tensor:
    rule = dataclasses.replace(rule, disable_channelwise_axes=True)
  model = qwix.quantize_model(Head(cfg), qwix.QtProvider([rule]))
  # Channels of different ranges, each with its largest |entry| positive: that entry lands on the edge of int8's
  # top bucket (127.5), on either side by float32's rounding of the scale, and only +127.5 gives 127 either way.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16, 32)).astype(np.float32)
  x[:, 0] = 5  # each row's largest (the rows are then scaled from 0.1 to 3)
  x *= np.linspace(0.1, 3, 16, dtype=np.float32)[:, None]
  w = rng.normal(size=(32, 24)).astype(np.float32)
  w[0] = 5  # each column's largest (the columns then scaled from 0.2 to 2)
  w *= np.linspace(0.2, 2, 24, dtype=np.float32)
  g = rng.normal(size=(16, 24)).astype(np.float32)
  g[:, 0], g[-1] = 100, 1000  # each row's largest after w's scales, each column's after x's (x's last row is largest)
  params = {"logits_dense": {"kernel": jnp.asarray(w)}}

  def loss(p, x):
    y = model.apply({"params": p}, x)
    return jnp.sum(y * g), y

  (_, y), (dp, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, jnp.asarray(x))
  weight, _, bwd = (jnp.dtype(t).name for t in quantizations.TRAINING[name])
  want_y, want_dx, want_dw = reference(x, w, g, weight, bwd, per_tensor)
  for got, want in ((y, want_y), (dx, want_dx), (dp["logits_dense"]["kernel"], want_dw)):
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
  # The reference is not the float product: quantization shows (int8 about 1%, fp8 about 5% of a typical entry).
  assert np.abs(want_y - x.astype(np.float64) @ w).max() > 1e-3 * np.abs(want_y).max()


# Scopes of jax's transforms in an op_name (flax's modules and methods aside).
JAX_SCOPES = ("while", "body", "closed_call", "checkpoint", "rematted_computation", "Transformer", "OutputHead")


def _quantized_modules(cfg) -> set[str]:
  """The module paths of the integer (s8 x s8 -> s32) dots in the optimized HLO of loss_fn's value and gradient,
  read from each dot's op_name (flax's name stack), methods' scopes and jax's transforms left out."""
  model = quantizations.quantize_model(models.Transformer(cfg, None), cfg)
  abstract = jax.eval_shape(lambda: model.init({"params": jax.random.key(0)}, *models.init_inputs(1, 8)))["params"]
  params = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), nn.unbox(abstract))
  grad = jax.jit(jax.value_and_grad(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[0]))
  hlo = grad.lower(params, train_batch(cfg)).compile().as_text()
  paths = set()
  for kind, op_name in re.findall(r"= (\w+)\[[^\n]* (?:dot|ragged-dot)\([^\n]*op_name=\"([^\"]*)\"", hlo):
    if kind == "s32":
      scopes = op_name.split("/")[:-1]
      paths.add("/".join(s for s in scopes if "(" not in s and "." not in s and s not in JAX_SCOPES))
  return paths


ATTENTION = {f"layers/self_attention/{p}" for p in ("query", "key", "value", "out")}
EXPERTS = {"layers/mlp/experts", *(f"layers/mlp/shared/{p}" for p in ("wi_0", "wi_1", "wo"))}


@pytest.mark.parametrize(
  ("args", "want"),
  [
    ((*MOE, "quantization_targets=[attention]"), ATTENTION),
    ((*MOE, "quantization_targets=[moe]"), EXPERTS),  # dropless: the CPU's tiled grouped matmul
    ((*MOE, "quantization_targets=[moe]", "capacity_factor=1.0"), EXPERTS),
    ((*MOE, "quantization_targets=[moe]", "sparse_matmul=false"), EXPERTS),
    ((*MOE, "quantization_targets=[head]"), {"logits_dense"}),
    (("quantization_targets=[head]", "num_vocab_tiling=4"), {"logits_dense"}),  # the loss's models.OutputHead
    (("quantization_targets=[mlp]",), {f"layers/mlp/{p}" for p in ("wi_0", "wi_1", "wo")}),
    (
      (
        "quantization_targets=[mlp, attention]",
        "fused_mlp=true",
        "fused_qkv=true",
        "override_model_config=true",
        "base_num_kv_heads=4",
      ),
      {"layers/mlp", "layers/mlp/wo", "layers/self_attention", "layers/self_attention/out"},
    ),
  ],
  ids=["attention", "moe_dropless", "moe_capacity", "moe_dense", "head", "head_vocab_tiling", "mlp", "fused"],
)
def test_each_target_quantizes_exactly_its_matmuls(args, want):
  """Each quantization_targets entry makes int8 dots of its matmuls and no others: the router (mlp/gate), attention's
  score and value products and the experts' one-hot dispatch and combine stay float. With fused_qkv the query, key and
  value projections are one matmul in self_attention itself, and with fused_mlp the wi_i are one in mlp itself."""
  assert _quantized_modules(config("quantization=int8", "scan_layers=true", *args)) == want


def _loss_and_grads(cfg, params, batch, devices):
  mesh = sharding.create_mesh(cfg, devices) if len(devices) > 1 else None
  model = quantizations.quantize_model(models.Transformer(cfg, mesh), cfg)
  if mesh is not None:
    params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  grad = jax.value_and_grad(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[0])
  return jax.jit(grad)(params, batch)


def _largest_differences(grads, reference) -> np.ndarray:
  """Each gradient leaf's largest difference from the reference's, over the reference's largest entry."""
  return np.array(
    [
      np.abs(np.asarray(g) - np.asarray(r)).max() / (np.abs(np.asarray(r)).max() + 1e-6)
      for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference), strict=True)
    ]
  )


def test_int8_loss_and_grads_on_four_devices_equal_one_device():
  """int8 (attention, MLP and head) on a 2 x 2 fsdp x tensor mesh against one device. The scales are reductions the
  partitioner carries across devices, so the same values are quantized; only float32 sums in another order (tensor
  parallelism's partial sums) move a few values across a bucket's edge. Measured: the loss within 2e-6, the gradients
  within 1.5% of each one's largest entry, where int8 itself moves them 6.7% from float; asserted: the loss within
  1e-5, the gradients within 3%, and under half of quantization's own effect on every leaf.

  Calibration absmax,1.01 rather than absmax: absmax maps each channel's largest |value| onto 127.5, the edge between
  the buckets 127 and 128 (clipped to 127), and -127.5 between -127 and -128, where float32's rounding of the scale
  decides; two compilations of the same step (on 1 and 4 devices) round some of those differently, a bucket's step
  on each channel's largest entry (about 3% of the gradients here). A 1% wider range takes every maximum off the edge.
  The experts are left out: under shard_map each device quantizes its own rows and weight shard (moe.RoutedExperts)."""
  calibration = [f"{k}_quantization_calibration_method=absmax,1.01" for k in ("weight", "act", "bwd")]
  common = ("quantization_targets=[attention, mlp, head]", *calibration)
  mesh = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
  one = config("quantization=int8", *common)
  params = nn.unbox(models.Transformer(one, None).init({"params": jax.random.key(0)}, *models.init_inputs(1, 8))["params"])
  batch = train_batch(one, rows=4)
  loss1, grads1 = _loss_and_grads(one, params, batch, jax.devices()[:1])
  loss4, grads4 = _loss_and_grads(
    config("quantization=int8", *common, *mesh, num_devices=4), params, batch, jax.devices()[:4]
  )
  _, float_grads = _loss_and_grads(config(*common), params, batch, jax.devices()[:1])
  np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
  sharded, quantized = _largest_differences(grads4, grads1), _largest_differences(grads1, float_grads)
  assert np.all(sharded <= 0.03) and np.all(sharded < 0.5 * quantized), (sharded, quantized)


def test_experts_by_ragged_dot_are_quantized(monkeypatch):
  """The dropless experts as a GPU (and TPU without megablox) runs them, jax.lax.ragged_dot: qwix's quantized
  ragged_dot makes them integer matmuls too (the platform the MoE block reads is made "gpu"; XLA's CPU runs it)."""
  cfg = config("quantization=int8", "quantization_targets=[moe]", *MOE)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert _quantized_modules(cfg) == EXPERTS


@pytest.mark.parametrize("name", ["int8", "fp8_full"])
def test_quantized_and_unquantized_runs_have_the_same_state(name):
  """A checkpoint is the train state's tree: a quantized run's (params in weight_dtype, optimizer state) has the
  tree, shapes, dtypes and shardings of an unquantized run's, MoE experts included, so each restores the other's."""
  plain = step_lib.build(config(*MOE, num_devices=1), jax.devices()[:1]).layout.abstract
  quantized = step_lib.build(config(*MOE, f"quantization={name}", num_devices=1), jax.devices()[:1]).layout.abstract
  assert jax.tree_util.tree_structure(quantized) == jax.tree_util.tree_structure(plain)
  for a, b in zip(jax.tree_util.tree_leaves(quantized), jax.tree_util.tree_leaves(plain), strict=True):
    assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)


@pytest.mark.slow  # train.py twice each way (about 20 s); the fast sibling compares the states' layouts above
def test_checkpoint_of_a_quantized_run_loads_into_an_unquantized_one_and_back(tmp_path):
  """train.py int8 writes a checkpoint, an unquantized run resumes from it (load_full_state_path), and the reverse."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  for first, second in (("int8", ""), ("", "fp8_full")):
    out = tmp_path / f"from_{first or 'float'}"
    common = ("enable_checkpointing=true", "async_checkpointing=false", f"base_output_directory={out}")
    args = overrides(*common, "run_name=a", "steps=2", f"quantization={first}")
    proc = run([sys.executable, "MaxText/train.py", BASE_YML, *args], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = next((out / "a" / "checkpoints").glob("*/items"))
    args = overrides(*common, "run_name=b", "steps=3", f"quantization={second}", f"load_full_state_path={items}")
    proc = run([sys.executable, "MaxText/train.py", BASE_YML, *args], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [int(n) for n in re.findall(r"completed step: (\d+),", proc.stdout + proc.stderr)]
    assert steps == [2], (proc.stdout + proc.stderr)[-3000:]  # resumed after the first run's 2 steps


@pytest.mark.parametrize(
  ("args", "key"),
  [
    (("quantization=int9",), "quantization"),
    (("quantization=int8", "use_qwix_quantization=false"), "use_qwix_quantization"),
    (("quantization=int8", "quantization_targets=[attention, router]"), "quantization_targets"),
    (("quantization=int8", "quantization_targets=[head]", "logits_via_embedding=true"), "logits_via_embedding"),
    (("quantization=int8", "quantization_local_shard_count=0"), "quantization_local_shard_count"),
    (("quantization=fp8", "quantization_local_shard_count=-2"), "quantization_local_shard_count"),
    (("quantization=int8", "quantization_local_shard_count=3"), "quantization_local_shard_count"),  # 64 tokens
    (("quantization=int8", "weight_quantization_calibration_method=bogus"), "weight_quantization_calibration_method"),
    (("quantization=int8", "act_quantization_calibration_method=rms"), "act_quantization_calibration_method"),
    (("quantization=int8", "bwd_quantization_calibration_method=absmax,x"), "bwd_quantization_calibration_method"),
    (("quantization=int8", "bwd_quantization_calibration_method=fixed,1,2"), "bwd_quantization_calibration_method"),
    (("quantization=int8w", "fused_qkv=true", "override_model_config=true", "base_num_kv_heads=4"), "fused_qkv"),
    (("quantization=int4w", "fused_mlp=true", "quantization_targets=[moe]"), "fused_mlp"),
  ],
)
def test_bad_quantization_keys_are_one_line_errors_naming_the_key(args, key):
  """Each one otherwise ends in a traceback from inside qwix at the first quantized matmul (a zero, negative or
  non-dividing tile count, an unknown calibration) or, for the fused projections under weight-only quantization,
  leaves their kernels float unseen."""
  with pytest.raises(ConfigError, match=key) as e:
    config(*args)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize(
  "args",
  [
    ("quantization=int8", "weight_quantization_calibration_method=absmax,1.01", "act_quantization_calibration_method=rms,3"),
    ("quantization=fp8_full", "bwd_quantization_calibration_method=fixed,-4,4", "quantization_local_shard_count=2"),
    (
      "quantization=int8w",
      "fused_qkv=true",
      "quantization_targets=[mlp]",
      "override_model_config=true",
      "base_num_kv_heads=4",
    ),
    ("quantization=int8", "fused_qkv=true", "fused_mlp=true", "override_model_config=true", "base_num_kv_heads=4"),
  ],
)
def test_valid_quantization_keys_pass(args):
  config(*args)


GPU = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")


@pytest.mark.parametrize("name", ["fp8", "fp8_full"])
def test_fp8_on_a_gpu_without_fp8_matmuls_is_refused(name):
  """Below compute capability 8.9 (an A100 is 8.0): one line naming the key; an H100 (9.0), the CPU and a TPU pass."""
  cfg = config(f"quantization={name}")
  with pytest.raises(ConfigError, match=f"quantization={name} needs fp8") as e:
    quantizations.check_devices(cfg, GPU)
  assert "\n" not in str(e.value) and "8.0" in str(e.value)
  hopper = types.SimpleNamespace(**{**vars(GPU), "compute_capability": "9.0"})
  for ok in (hopper, jax.devices()[0], types.SimpleNamespace(platform="tpu")):
    quantizations.check_devices(cfg, ok)
  quantizations.check_devices(config("quantization=int8"), GPU)


def test_megablox_experts_on_tpu_are_refused_when_quantized():
  """megablox's kernel takes no quantized operands: quantized MoE experts on TPU need megablox=false (ragged_dot)."""
  tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite")
  with pytest.raises(ConfigError, match="megablox=true"):
    quantizations.check_devices(config(*MOE, "quantization=int8", "megablox=true"), tpu)
  quantizations.check_devices(config(*MOE, "quantization=int8", "megablox=false"), tpu)
  quantizations.check_devices(config(*MOE, "quantization=int8", "quantization_targets=[attention]"), tpu)


def test_train_py_exits_2_with_one_line_for_an_unknown_quantization():
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  proc = run([sys.executable, "MaxText/train.py", BASE_YML, *overrides("quantization=fp4")], env, cwd=REPO_ROOT)
  assert proc.returncode == 2, proc.stdout + proc.stderr
  assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and "quantization" in proc.stderr

"""The decoder: causality, segment isolation, RoPE, scanned vs unrolled layers and every remat policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import cli
from MaxText.common_types import ConfigError
from MaxText.layers import embeddings, models
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import config


def _init(cfg, batch=2):
  model = models.Transformer(cfg)
  tokens, segments, positions = models.init_inputs(batch, cfg.max_target_length)
  params = nn.meta.unbox(model.init({"params": jax.random.key(0)}, tokens, segments, positions))["params"]
  return model, params


def _batch(cfg, batch=2, seed=1):
  rng = np.random.default_rng(seed)
  length = cfg.max_target_length
  tokens = rng.integers(0, cfg.vocab_size, (batch, length + 1)).astype(np.int32)
  ones = np.ones((batch, length), np.int32)
  return {
    "inputs": tokens[:, :-1],
    "inputs_segmentation": ones,
    "inputs_position": np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length)),
    "targets": tokens[:, 1:],
    "targets_segmentation": ones,
  }


def test_causality_gradient_is_exactly_zero():
  """d logits[i] / d input[j] == 0 exactly for every j > i."""
  cfg = config("max_target_length=16")
  model, params = _init(cfg, batch=1)
  batch = _batch(cfg, batch=1)
  x = jax.random.normal(jax.random.key(3), (1, 16, cfg.emb_dim))

  def logits_sum_at(i, x):
    out = model.apply(
      {"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"], input_embeddings=x
    )
    return jnp.sum(out[0, i])

  for i in (0, 5, 15):
    grad = np.asarray(jax.grad(logits_sum_at, argnums=1)(i, x))[0]  # [length, embed]
    assert np.all(grad[i + 1 :] == 0.0), f"position {i} sees the future"
    assert np.any(grad[: i + 1] != 0.0), "the check must be able to fail: the past is visible"


def test_segments_do_not_attend_to_each_other():
  """In a packed row [doc A | doc B], A's logits ignore B, and B's equal B decoded alone."""
  cfg = config("max_target_length=16")
  model, params = _init(cfg, batch=1)
  rng = np.random.default_rng(0)
  a, b, b2 = (rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (6, 10, 10))
  segments = np.array([[1] * 6 + [2] * 10], np.int32)
  positions = np.array([list(range(6)) + list(range(10))], np.int32)

  def run(tokens, seg, pos):
    return np.asarray(model.apply({"params": params}, jnp.asarray(tokens)[None] if tokens.ndim == 1 else tokens, seg, pos))

  packed = run(np.concatenate([a, b]), segments, positions)
  packed_other = run(np.concatenate([a, b2]), segments, positions)
  np.testing.assert_array_equal(packed[0, :6], packed_other[0, :6])
  alone = run(b, np.ones((1, 10), np.int32), np.arange(10, dtype=np.int32)[None])
  np.testing.assert_allclose(packed[0, 6:], alone[0], rtol=1e-5, atol=1e-5)


def _rope_reference(x, positions, theta, scaling=None):
  """Float64 RoPE in the Hugging Face Llama layout, with Meta's Llama 3.1 `apply_scaling` written as loops."""
  d = x.shape[-1]
  freqs = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  if scaling:
    factor, low, high, old = scaling
    new = []
    for f in freqs:
      wavelen = 2 * np.pi / f
      if wavelen < old / high:
        new.append(f)
      elif wavelen > old / low:
        new.append(f / factor)
      else:
        smooth = (old / wavelen - low) / (high - low)
        new.append((1 - smooth) * f / factor + smooth * f)
    freqs = np.array(new)
  angle = positions[..., None, None] * freqs
  cos, sin = np.concatenate([np.cos(angle)] * 2, -1), np.concatenate([np.sin(angle)] * 2, -1)
  rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
  return x * cos + rotated * sin


@pytest.mark.parametrize("rope_type", ["default", "llama3.1"])
def test_rope_matches_float64_reference(rope_type):
  cfg = config("head_dim=64", f"rope_type={rope_type}", "rope_max_timescale=500000", override_model_config="true")
  x = np.random.default_rng(0).normal(size=(2, 40, 3, 64))
  positions = np.stack([np.arange(40), np.arange(1000, 1040)])
  out = embeddings.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), embeddings.rope_frequencies(cfg, 64))
  scaling = (8.0, 1.0, 4.0, 8192.0) if rope_type == "llama3.1" else None
  expected = _rope_reference(x, positions, 500000.0, scaling)
  # Row 0 (positions < 40) must agree to float32 rounding. Row 1 forms angles up to ~1040 rad in float32,
  # whose rounding (half an ulp) moves an output by at most |x| * ulp(1040): the bound used there.
  np.testing.assert_allclose(np.asarray(out)[0], expected[0], rtol=1e-5, atol=1e-5)
  bound = np.abs(x).max() * np.spacing(np.float32(1040.0))
  np.testing.assert_allclose(np.asarray(out)[1], expected[1], rtol=0, atol=bound)


def assert_grads_close(actual, expected, name=""):
  """Float32 gradients from two code paths: remat and scan change how XLA fuses and orders the sums, so an
  element may differ by a few ulps of the largest partial sums of its tensor. Hence rtol 1e-5 plus an
  absolute 1e-6 of the tensor's largest magnitude (an element that cancels to ~0 has no relative precision).
  """
  expected = np.asarray(expected)
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max(), err_msg=name)


def _loss_and_grads(cfg, params, batch):
  model = models.Transformer(cfg)
  fn = jax.jit(jax.value_and_grad(lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True)[0]))
  return fn(params)


def _assert_same_loss_and_grads(cfg, reference_cfg, params, batch):
  """Two configs of one model give the same float32 loss and gradients on `batch`."""
  (loss, grads), (ref_loss, ref_grads) = _loss_and_grads(cfg, params, batch), _loss_and_grads(reference_cfg, params, batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree_util.tree_map(assert_grads_close, grads, ref_grads)


def _unstack_layers(params, num_layers):
  """Scanned params (leading `layers` axis under 'layers') -> unrolled params ('layers_0', ...)."""
  params = dict(params)
  stacked = params.pop("layers")
  for i in range(num_layers):
    params[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
  return params


@pytest.mark.parametrize("remat_policy", list(models.REMAT_POLICIES))
def test_scanned_unrolled_and_remat_policies_agree(remat_policy):
  """Loss and gradients of (scan, policy) equal those of the unrolled model without remat (float32)."""
  reference_cfg = config("scan_layers=false", "remat_policy=none", "max_target_length=32")
  cfg = config("scan_layers=true", f"remat_policy={remat_policy}", "max_target_length=32")
  _, params = _init(cfg)
  batch = _batch(cfg)
  loss, grads = _loss_and_grads(cfg, params, batch)
  ref_loss, ref_grads = _loss_and_grads(reference_cfg, _unstack_layers(params, cfg.num_decoder_layers), batch)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  flat = jax.tree_util.tree_leaves_with_path(_unstack_layers(grads, cfg.num_decoder_layers))
  ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
  for path, g in flat:
    assert_grads_close(g, ref[path], jax.tree_util.keystr(path))


def test_unrolled_remat_matches_no_remat():
  cfg = config("scan_layers=false", "remat_policy=full", "max_target_length=32")
  reference_cfg = config("scan_layers=false", "remat_policy=none", "max_target_length=32")
  _, params = _init(cfg)
  batch = _batch(cfg)
  _assert_same_loss_and_grads(cfg, reference_cfg, params, batch)


def test_cpu_compiler_options_keep_loss_and_grads():
  """cli.compiler_options' CPU tuning swaps XLA kernels, not the math: same loss and gradients."""
  cfg = config("max_target_length=32")
  _, params = _init(cfg)
  model, batch = models.Transformer(cfg), _batch(cfg)
  fn = jax.jit(jax.value_and_grad(lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True)[0]))
  tuned = fn.lower(params).compile({"xla_cpu_experimental_ynn_fusion_type": cli.CPU_YNN_FUSIONS})
  (loss, grads), (ref_loss, ref_grads) = tuned(params), fn(params)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree_util.tree_map(assert_grads_close, grads, ref_grads)


def test_compiler_options_only_when_a_device_has_spare_cores(monkeypatch):
  mesh_of = lambda n: jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))  # noqa: E731
  monkeypatch.setattr("os.cpu_count", lambda: 2)
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  expected = {} if jax.__version_info__ < (0, 11) else {"xla_cpu_experimental_ynn_fusion_type": cli.CPU_YNN_FUSIONS}
  assert cli.compiler_options(mesh_of(1)) == expected
  assert cli.compiler_options(mesh_of(2)) == {}
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
  assert cli.compiler_options(mesh_of(1)) == {}


def _apply_capturing(model, params, batch, module_names):
  """(logits, {module name: its output}) of a forward pass, capturing the outputs of the named submodules."""
  logits, state = model.apply(
    {"params": params},
    batch["inputs"],
    batch["inputs_segmentation"],
    batch["inputs_position"],
    capture_intermediates=lambda module, method: module.name in module_names and method == "__call__",
    mutable=["intermediates"],
  )
  found = {}
  for path, value in jax.tree_util.tree_leaves_with_path(state["intermediates"]):
    names = [getattr(k, "key", None) for k in path]
    found.setdefault(next(n for n in reversed(names) if n in module_names), value)
  return logits, found


def test_tied_logits_are_the_final_hidden_states_times_the_embedding():
  """logits_via_embedding=true: no output kernel, and logits = decoder_norm's output @ embedding^T (float64)."""
  cfg = config("logits_via_embedding=true", override_model_config="true")
  model, params = _init(cfg, batch=1)
  assert "logits_dense" not in params
  logits, found = _apply_capturing(model, params, _batch(cfg, batch=1), {"decoder_norm"})
  hidden = np.asarray(found["decoder_norm"], np.float64)  # [1, length, embed]
  expected = hidden @ np.asarray(params["token_embedder"]["embedding"], np.float64).T
  # float32 with matmul_precision=highest: a 32-term dot product is exact to a few float32 ulps.
  np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_bf16_activations_over_fp32_weights():
  """dtype=bfloat16 computes in bfloat16 (the layers' outputs are bfloat16) from float32 weights, and its logits
  agree with a float32 forward pass on the same weights to bfloat16's precision."""
  cfg = config("dtype=bfloat16", "weight_dtype=float32", "scan_layers=false")  # unscanned: the layers' outputs are captured
  model, params = _init(cfg, batch=1)
  assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
  batch = _batch(cfg, batch=1)
  out, found = _apply_capturing(model, params, batch, {"self_attention", "mlp", "decoder_norm"})
  assert out.dtype == jnp.bfloat16
  assert {name: jnp.dtype(x.dtype) for name, x in found.items()} == dict.fromkeys(found, jnp.dtype(jnp.bfloat16))
  assert set(found) == {"self_attention", "mlp", "decoder_norm"}
  ref = models.Transformer(config("dtype=float32", "scan_layers=false")).apply(
    {"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"]
  )
  assert ref.dtype == jnp.float32
  # bfloat16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2% per operation); through 2 layers the logits
  # stay within 3% of their largest magnitude, while a wrong bfloat16 path (an overflow, a dropped scale) is off
  # by far more.
  error = np.abs(np.asarray(out, np.float32) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max()
  assert error < 0.03, error


def test_dropout_is_active_only_in_training():
  cfg = config("dropout_rate=0.5")
  model, params = _init(cfg, batch=1)
  batch = _batch(cfg, batch=1)

  def run(deterministic, seed):
    return np.asarray(
      model.apply(
        {"params": params},
        batch["inputs"],
        batch["inputs_segmentation"],
        batch["inputs_position"],
        deterministic=deterministic,
        rngs={"dropout": jax.random.key(seed)},
      )
    )

  np.testing.assert_array_equal(run(True, 0), run(True, 1))
  assert not np.allclose(run(False, 0), run(False, 1))


def _dropout_inputs_and_outputs(cfg, batch_size: int, deterministic: bool) -> list[tuple[np.ndarray, np.ndarray]]:
  """(input, output) of every dropout call in a forward pass of the scanned, rematerialised decoder (each
  [layers, batch, length, embed]), recorded by a method interceptor that sows them where the call happens."""

  def record(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, nn.Dropout) and context.method_name == "__call__":
      context.module.sow("intermediates", "input_output", (args[0], out))
    return out

  model, params = _init(cfg, batch=batch_size)
  batch = _batch(cfg, batch=batch_size)
  with nn.intercept_methods(record):
    _, sown = model.apply(
      {"params": params},
      batch["inputs"],
      batch["inputs_segmentation"],
      batch["inputs_position"],
      deterministic=deterministic,
      rngs={"dropout": jax.random.key(7)},
      mutable=["intermediates"],
    )
  calls = []  # sow keeps a tuple of the calls of each module: here of (input, output) pairs

  def collect(tree):
    for key, value in tree.items():
      if key == "input_output":
        calls.extend((np.asarray(x, np.float64), np.asarray(y, np.float64)) for x, y in value)
      elif isinstance(value, dict):
        collect(value)

  collect(sown["intermediates"])
  return calls


def test_dropout_zeroes_its_rate_of_activations_and_scales_the_rest_by_one_over_keep():
  """dropout_rate p = 0.3 on the attention and MLP outputs (Srivastava et al. 2014, inverted dropout): the share of
  zeroed activations is p within 5 binomial standard deviations, sqrt(p (1 - p) / n), over the n independent draws
  (one per batch row and embedding feature per call: the mask is shared along the sequence, broadcast_dims); every
  kept activation is its input / (1 - p), to float32 rounding (rtol 1e-6, 15 times its 6e-8); deterministic calls
  pass their input unchanged. A rate of 1 - p, or a scaling by 1 / p or none, is far outside both bounds."""
  p = 0.3
  cfg = config(f"dropout_rate={p}", "max_target_length=8")
  calls = _dropout_inputs_and_outputs(cfg, batch_size=16, deterministic=False)
  assert len(calls) == 2  # the attention's and the MLP's, each stacked over the scanned layers
  draws = zeroed = 0
  for x, y in calls:
    assert x.shape == (cfg.num_decoder_layers, 16, 8, cfg.emb_dim) and np.all(x != 0)
    kept = y != 0
    np.testing.assert_array_equal(kept, np.broadcast_to(kept[:, :, :1, :], kept.shape))  # one mask per row
    np.testing.assert_allclose(y[kept], x[kept] / (1 - p), rtol=1e-6)
    draws, zeroed = draws + kept[:, :, 0, :].size, zeroed + int(np.sum(~kept[:, :, 0, :]))
  assert draws == 2 * cfg.num_decoder_layers * 16 * cfg.emb_dim
  bound = 5 * np.sqrt(p * (1 - p) / draws)  # 0.051 for the 2048 draws of the tiny model
  assert abs(zeroed / draws - p) <= bound, (zeroed / draws, p, bound)

  calls = _dropout_inputs_and_outputs(cfg, batch_size=16, deterministic=True)
  assert len(calls) == 2
  for x, y in calls:
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("fused", [("fused_qkv=true",), ("fused_mlp=true",), ("fused_qkv=true", "fused_mlp=true")])
def test_fused_projections_equal_separate_ones(fused):
  """fused_qkv / fused_mlp: one matmul over the same parameters gives the same loss and gradients."""
  heads = ("override_model_config=true", "base_num_kv_heads=4", "max_target_length=32")
  reference_cfg = config(*heads)
  cfg = config(*heads, *fused)
  _, params = _init(cfg)
  batch = _batch(cfg)
  _assert_same_loss_and_grads(cfg, reference_cfg, params, batch)


def test_fused_qkv_is_refused_for_grouped_query_attention():
  with pytest.raises(ConfigError, match="fused_qkv=true needs base_num_kv_heads == base_num_query_heads"):
    config("fused_qkv=true")  # The tiny model has 4 query heads over 2 KV heads.


def test_iota_embedding_gives_the_gathered_rows_exactly():
  """use_iota_embed: a one-hot matmul instead of a gather, bit for bit (bf16 and float32 activations)."""
  for dtype in ("bfloat16", "float32"):
    cfg, iota_cfg = config(f"dtype={dtype}"), config(f"dtype={dtype}", "use_iota_embed=true")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16)), jnp.int32)
    table = {"params": {"embedding": jax.random.normal(jax.random.key(0), (cfg.vocab_size, cfg.emb_dim))}}
    gathered = embeddings.Embed(cfg).apply(table, tokens)
    one_hot = embeddings.Embed(iota_cfg).apply(table, tokens)
    assert one_hot.dtype == gathered.dtype
    np.testing.assert_array_equal(np.asarray(one_hot, np.float32), np.asarray(gathered, np.float32))


def test_logits_dot_in_fp32_computes_the_head_in_float32():
  """bf16 activations: logits_dot_in_fp32=true gives float32 logits equal to the float32 product of the final
  hidden states and the kernel; false gives the bf16 product, as MaxText does."""
  cfg = config("dtype=bfloat16", "max_target_length=16")
  fp32_cfg = config("dtype=bfloat16", "max_target_length=16", "logits_dot_in_fp32=true")
  model, params = _init(cfg)
  batch = _batch(cfg)
  args = (batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])
  hidden = model.apply({"params": params}, *args, return_hidden=True)
  kernel = params["logits_dense"]["kernel"]
  logits = models.Transformer(fp32_cfg).apply({"params": params}, *args)
  assert logits.dtype == jnp.float32
  want = jnp.einsum("ble,ev->blv", hidden.astype(jnp.float32), kernel, precision=jax.lax.Precision.HIGHEST)
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
  assert model.apply({"params": params}, *args).dtype == jnp.bfloat16


@pytest.mark.parametrize("extra", [(), ("logits_via_embedding=true", "final_logits_soft_cap=30.0")])
def test_vocab_tiling_equals_untiled_loss_and_grads(extra):
  """num_vocab_tiling=4: the same summed loss and gradients as the whole logits at once (float32), for an
  untied head and for a tied, soft-capped one; padding targets stay out of the loss."""
  cfg = config("max_target_length=32", *extra)
  tiled_cfg = config("max_target_length=32", "num_vocab_tiling=4", *extra)
  _, params = _init(cfg)
  batch = dict(_batch(cfg))
  batch["targets_segmentation"] = batch["targets_segmentation"].copy()
  batch["targets_segmentation"][1, 20:] = 0
  _assert_same_loss_and_grads(tiled_cfg, cfg, params, batch)


def test_vocab_tiling_must_divide_the_length():
  with pytest.raises(ConfigError, match="num_vocab_tiling=3 must be a positive divisor of max_target_length=64"):
    config("num_vocab_tiling=3")


def test_offloaded_remat_policies_offload_only_on_accelerators():
  """On the CPU, host memory is device memory: the *_offloaded policies are the saving ones they mirror."""
  assert models.remat_policy("qkv_proj_offloaded", "cpu") == models.REMAT_POLICIES["save_qkv_proj"]
  assert models.remat_policy("minimal_offloaded", "cpu") == models.REMAT_POLICIES["minimal"]
  for platform in ("tpu", "gpu"):
    assert models.remat_policy("qkv_proj_offloaded", platform) is models.OFFLOADED["qkv_proj_offloaded"]
    assert models.remat_policy("full", platform) is models.REMAT_POLICIES["full"]


@pytest.mark.parametrize(
  "family",
  [
    ("max_target_length=48",),  # Llama, GQA; 48 tokens in blocks of 16
    (  # Gemma 2: local and global layers alternate inside the scan (a traced window), soft-capped logits
      "decoder_block=gemma2",
      "override_model_config=true",
      "sliding_window_size=12",
      "attn_logits_soft_cap=5.0",
      "final_logits_soft_cap=30.0",
      "query_pre_attn_scalar=16",
      "max_target_length=48",
    ),
  ],
)
def test_flash_attention_model_equals_dot_product(family):
  """attention=flash (blockwise on the CPU) gives the loss and gradients of attention=dot_product, with packed
  documents and padding in the batch (float32)."""
  blocks = ("sa_block_q=16", "sa_block_kv=16")
  reference_cfg = config(*family, "attention=dot_product")
  cfg = config(*family, "attention=flash", *blocks)
  _, params = _init(cfg)
  batch = dict(_batch(cfg))
  segments = np.ones((2, 48), np.int32)
  segments[0, 20:] = 2  # two documents in row 0, padding at the end of row 1
  segments[1, 40:] = 0
  positions = np.stack([np.r_[np.arange(20), np.arange(28)], np.arange(48)]).astype(np.int32)
  batch.update(inputs_segmentation=segments, targets_segmentation=segments, inputs_position=positions)
  _assert_same_loss_and_grads(cfg, reference_cfg, params, batch)


def test_attention_kernel_mistakes_are_config_errors():
  with pytest.raises(ConfigError, match="attention=cudnn_flash_te is cuDNN fused attention, for NVIDIA GPUs"):
    config("attention=cudnn_flash_te")
  with pytest.raises(ConfigError, match="cuDNN fused attention has no logit soft cap"):
    config("attention=cudnn_flash_jax", "hardware=gpu", "dtype=bfloat16", "attn_logits_soft_cap=50.0")
  with pytest.raises(ConfigError, match="attention=flash \\(splash\\): length 64 is not a multiple of 128"):
    config("attention=flash", "hardware=tpu")
  assert config("attention=flash").attention == "flash"  # blockwise on the CPU takes any length

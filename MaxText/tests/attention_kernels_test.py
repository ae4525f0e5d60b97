"""Attention kernels against the reference `dot_product_attention`: outputs and gradients, on the CPU.

Every comparison runs both sides on the same float32 inputs at HIGHEST matmul precision, over GQA, packed
documents with padding, sliding windows (static and traced), soft caps and lengths that are not a multiple of the
block. The gradient is that of sum(out * w) for a fixed random w, with respect to q, k and v. Splash runs in
Pallas interpret mode; cuDNN's numerics need a GPU (skipped here), but its argument plumbing runs through
`jax.nn.dot_product_attention`'s XLA path, and its refusals are checked on the CPU.
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

from MaxText.layers import attention_kernels as ak
from MaxText.layers.attention_kernels import AttentionSettings
from MaxText.tests.helpers import BASE_YML

HIGHEST = jax.lax.Precision.HIGHEST
# Measured float32 errors against the reference (max abs, values O(1)): blockwise ~6e-7 forward, ~3e-6 gradients;
# splash ~6e-7 and ~3e-6. Both are reorderings of float32 sums over <= 256 keys, whose rounding is a few 1e-7
# relative; the bounds leave ~3x headroom and stay 100x below any masking or scaling error (>= 1e-3).
FWD_ATOL, GRAD_ATOL = 2e-6, 1e-5


def _config(**overrides):
  """The fields the kernels read, at base.yml's defaults, with 128-token splash blocks for short test lengths."""
  with open(BASE_YML, encoding="utf-8") as f:
    base = yaml.safe_load(f)
  values = {name: value for name, value in base.items() if name.startswith("sa_")}
  values.update({name: 128 for name in values if name.startswith("sa_block")})
  values.update(
    attention="autoselected",
    matmul_precision="highest",
    sliding_window_size=40,
    logical_axis_rules=tuple((name, tuple(axes)) for name, axes in base["logical_axis_rules"]),
    mesh_axes=tuple(base["mesh_axes"]),
  )
  values.update(overrides)
  return types.SimpleNamespace(**values)


def _packed(batch, length, docs):
  """segment_ids, positions [batch, length]: row 0 holds documents of the given lengths then padding (segment 0)
  to the end, the other rows one document each. Positions restart at 0 in every segment, padding included."""
  segment_ids = np.ones((batch, length), np.int32)
  positions = np.tile(np.arange(length, dtype=np.int32), (batch, 1))
  bounds = np.cumsum([0, *docs])
  assert bounds[-1] < length
  for n, (start, stop) in enumerate(zip(bounds[:-1], [*bounds[1:-1], length], strict=True)):
    segment_ids[0, start:stop] = n + 1
    positions[0, start:stop] = np.arange(stop - start)
  segment_ids[0, bounds[-1] :] = 0
  positions[0, bounds[-1] :] = np.arange(length - bounds[-1])
  return jnp.asarray(segment_ids), jnp.asarray(positions)


def _inputs(batch, length, heads, kv_heads, head_dim=8, docs=(10, 15), dtype=jnp.float32):
  kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(kq, (batch, length, heads, head_dim), dtype) * 0.5
  k = jax.random.normal(kk, (batch, length, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, length, kv_heads, head_dim), dtype)
  w = jax.random.normal(kw, q.shape, jnp.float32)
  return q, k, v, w, *_packed(batch, length, docs)


def _out_and_grads(attention, q, k, v, w, *args):
  """(attention(q, k, v, *args), d/d(q, k, v) of sum(out * w)), in one compiled function."""

  def run(q, k, v, w, *args):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, *args), q, k, v)
    return out, vjp(w.astype(out.dtype))

  return jax.jit(run)(q, k, v, w, *args)


def _assert_close(got, want, fwd_atol=FWD_ATOL, grad_atol=GRAD_ATOL):
  np.testing.assert_allclose(got[0], want[0], atol=fwd_atol, rtol=0, err_msg="output")
  for name, g, r in zip("qkv", got[1], want[1], strict=True):
    np.testing.assert_allclose(g, r, atol=grad_atol, rtol=0, err_msg=f"d{name}")


def _assert_as_accurate(got, bf16, exact):
  """Each of (out, dq, dk, dv) of `got` is within 1.5x (+1e-3) of the bf16 reference's max error against the
  float32 one: the kernel adds no error beyond bf16 rounding (measured: blockwise 0.5-1x dot_product's)."""
  for name, g, b, e in zip(
    "out dq dk dv".split(), (got[0], *got[1]), (bf16[0], *bf16[1]), (exact[0], *exact[1]), strict=True
  ):
    err = np.abs(np.asarray(g, np.float32) - e).max()
    ref_err = np.abs(np.asarray(b, np.float32) - e).max()
    assert err <= 1.5 * ref_err + 1e-3, (name, err, ref_err)


def _reference(window=0, cap=0.0):
  settings = AttentionSettings(window=window, cap=cap, precision=HIGHEST)
  return lambda q, k, v, seg, pos: ak.dot_product_attention(q, k, v, seg, pos, settings)


# ------------------------------------------------------------------------------------------------- blockwise


@pytest.mark.parametrize(
  "heads,kv_heads,block_q,block_kv,window,cap",
  [
    (4, 2, 16, 8, 0, 0.0),  # GQA; several key blocks per query block
    (4, 1, 8, 16, 7, 5.0),  # MQA, sliding window, soft cap; several query blocks per key block
  ],
)
def test_blockwise_matches_dot_product(heads, kv_heads, block_q, block_kv, window, cap):
  """Length 37 (no multiple of either block), two documents and padding in row 0, one document in row 1."""
  q, k, v, w, seg, pos = _inputs(2, 37, heads, kv_heads)

  def blockwise(q, k, v, seg, pos):
    settings = AttentionSettings(window=window, cap=cap, precision=HIGHEST, block_q=block_q, block_kv=block_kv)
    return ak.blockwise_attention(q, k, v, seg, pos, settings)

  _assert_close(
    _out_and_grads(blockwise, q, k, v, w, seg, pos), _out_and_grads(_reference(window, cap), q, k, v, w, seg, pos)
  )


def test_blockwise_traced_window_in_scan():
  """Gemma 2's pattern: one scan over layers whose window (12, then 0 = global) is a traced scan input."""
  q, k, v, w, seg, pos = _inputs(1, 48, 2, 1, docs=(30,))

  def layers(attention, windows):
    def run(q, k, v, seg, pos):
      def layer(x, window):
        out = attention(x, k, v, seg, pos, window)
        return out, out

      return jax.lax.scan(layer, q, jnp.asarray(windows, jnp.int32))[1].sum(0)

    return run

  def blockwise(q, k, v, seg, pos, window):
    return ak.blockwise_attention(q, k, v, seg, pos, AttentionSettings(window, precision=HIGHEST, block_q=16, block_kv=16))

  def reference(q, k, v, seg, pos, window):
    return ak.dot_product_attention(q, k, v, seg, pos, AttentionSettings(window, precision=HIGHEST))

  want = _out_and_grads(layers(reference, [12, 0]), q, k, v, w, seg, pos)
  _assert_close(_out_and_grads(layers(blockwise, [12, 0]), q, k, v, w, seg, pos), want)
  # The window mattered: without it the reference gives another answer.
  unwindowed = _out_and_grads(layers(reference, [0, 0]), q, k, v, w, seg, pos)
  assert np.abs(np.asarray(want[0]) - unwindowed[0]).max() > 1e-2


def test_blockwise_bfloat16_is_as_accurate_as_dot_product():
  """bf16 inputs: against a float32 reference on the same (bf16-rounded) inputs, blockwise's error stays within
  that of dot_product run in bf16 (both round probabilities and outputs to bf16; blockwise keeps float32
  statistics), so the kernel adds no error of its own beyond bf16's."""
  q, k, v, w, seg, pos = _inputs(2, 37, 4, 2, dtype=jnp.bfloat16)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  exact = _out_and_grads(_reference(), *f32, w, seg, pos)

  def blockwise(q, k, v, seg, pos):
    return ak.blockwise_attention(q, k, v, seg, pos, AttentionSettings(precision=HIGHEST, block_q=16, block_kv=8))

  got = _out_and_grads(blockwise, q, k, v, w, seg, pos)
  bf16 = _out_and_grads(_reference(), q, k, v, w, seg, pos)
  assert got[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in got[1])
  _assert_as_accurate(got, bf16, exact)


def test_blockwise_memory_grows_linearly():
  """The compiled backward's temporaries (batch 1, one head, head_dim 16, 128-token blocks): at length 4096 far
  below one [length, length] float32 score matrix (64 MiB), and going from 2048 to 4096 tokens adds at most
  512 bytes per token (8 float32 rows of head_dim; measured ~0.9 MiB in all, ~140 bytes per added token), where
  dot_product adds at least one score matrix's growth (48 MiB), as its own check shows."""

  def temp_bytes(attention, length):
    q = jax.ShapeDtypeStruct((1, length, 1, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    loss = jax.grad(lambda q, k, v, seg, pos: attention(q, k, v, seg, pos).sum(), argnums=(0, 1, 2))
    return jax.jit(loss).lower(q, q, q, ids, ids).compile().memory_analysis().temp_size_in_bytes

  def blockwise(q, k, v, seg, pos):
    return ak.blockwise_attention(q, k, v, seg, pos, AttentionSettings(block_q=128, block_kv=128))

  scores = 4096 * 4096 * 4
  small, large = temp_bytes(blockwise, 2048), temp_bytes(blockwise, 4096)
  assert large < scores / 32, large
  assert large - small < 2048 * 512, (small, large)
  dot_small, dot_large = temp_bytes(_reference(), 2048), temp_bytes(_reference(), 4096)
  assert dot_large > scores and dot_large - dot_small > 2048 * 512, (dot_small, dot_large)


# ---------------------------------------------------------------------------------------------------- splash


@pytest.mark.parametrize(
  "kv_heads,window,cap,fused",
  [
    (2, 40, 3.0, False),  # GQA, local mask, soft cap, separate dq and dkv kernels
    (1, 0, 0.0, True),  # MQA kernel, causal mask, fused backward
  ],
)
def test_splash_matches_dot_product(kv_heads, window, cap, fused):
  """Interpret mode, length 256 in 128-token blocks, three documents and padding in row 0."""
  cfg = _config(sa_use_fused_bwd_kernel=fused)
  q, k, v, w, seg, pos = _inputs(2, 256, 4, kv_heads, docs=(100, 30, 106))

  def splash(q, k, v, seg, pos):
    settings = AttentionSettings.from_config(cfg, window=window, cap=cap, interpret=True)
    return ak.splash_attention(q, k, v, seg, pos, settings)

  _assert_close(_out_and_grads(splash, q, k, v, w, seg, pos), _out_and_grads(_reference(window, cap), q, k, v, w, seg, pos))


def test_splash_traced_window_switches_kernels():
  """A traced window runs the local kernel for config.sliding_window_size, the causal one for 0, and blockwise
  attention for any other value: all three equal the reference."""
  cfg = _config()
  q, k, v, w, seg, pos = _inputs(1, 256, 2, 1, docs=(150,))
  splash = jax.jit(
    lambda q, k, v, seg, pos, window: ak.splash_attention(
      q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=window, interpret=True)
    )
  )
  for window in (cfg.sliding_window_size, 0, 24):
    want = ak.dot_product_attention(q, k, v, seg, pos, AttentionSettings(window, precision=HIGHEST))
    got = splash(q, k, v, seg, pos, jnp.asarray(window, jnp.int32))
    np.testing.assert_allclose(got, want, atol=FWD_ATOL, rtol=0, err_msg=f"window={window}")


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices (conftest simulates 8 CPU devices)")
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_splash_under_shard_map(kv_heads):
  """Mesh data=2 x tensor=2 with base.yml's rules: batch split over data, heads over tensor; with one kv head
  (which cannot be split in two) the kv heads are repeated per query head."""
  cfg = _config()
  shape = [2 if axis in ("data", "tensor") else 1 for axis in cfg.mesh_axes]
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(shape), cfg.mesh_axes)
  q, k, v, w, seg, pos = _inputs(2, 256, 4, kv_heads, docs=(100, 30, 106))

  def splash(q, k, v, seg, pos):
    return ak.splash_attention(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=40, interpret=True), mesh)

  _assert_close(_out_and_grads(splash, q, k, v, w, seg, pos), _out_and_grads(_reference(40), q, k, v, w, seg, pos))


def test_splash_refuses_lengths_that_do_not_fit_its_blocks():
  with pytest.raises(ValueError, match=r"length 200 .*use attention=dot_product"):
    ak.splash_block_sizes(_config(), 200)
  with pytest.raises(ValueError, match=r"sa_block_kv=192"):
    ak.splash_block_sizes(_config(sa_block_kv=192), 256)
  assert ak.splash_block_sizes(_config(sa_block_q=512), 256).block_q == 256  # clipped to the length


# ----------------------------------------------------------------------------------------------------- cuDNN


@pytest.mark.parametrize("window", [0, 7])
def test_cudnn_call_through_xla(window):
  """The exact jax.nn.dot_product_attention call of the cuDNN path (document mask, causal flag, window, GQA,
  scale 1), run by its XLA implementation: equal to the reference. Packed rows, so the mask matters."""
  q, k, v, _, seg, pos = _inputs(2, 36, 4, 2)
  settings = AttentionSettings(window)
  got = jax.jit(lambda q, k, v, seg: ak.cudnn_attention(q, k, v, seg, settings, implementation="xla"))(q, k, v, seg)
  want = jax.jit(_reference(window))(q, k, v, seg, pos)
  np.testing.assert_allclose(got, want, atol=FWD_ATOL, rtol=0)


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="cuDNN fused attention needs an NVIDIA GPU")
@pytest.mark.parametrize("window", [0, 7])
def test_cudnn_matches_dot_product_on_gpu(window):
  """bf16 inputs: cuDNN's error against a float32 reference is at most 1.5x dot_product's in bf16 (+1e-3)."""
  q, k, v, w, seg, pos = _inputs(2, 256, 4, 2, head_dim=64, docs=(100, 30, 106), dtype=jnp.bfloat16)
  exact = _out_and_grads(_reference(window), *[x.astype(jnp.float32) for x in (q, k, v)], w, seg, pos)
  settings = AttentionSettings(window)
  got = _out_and_grads(lambda q, k, v, seg, pos: ak.cudnn_attention(q, k, v, seg, settings), q, k, v, w, seg, pos)
  bf16 = _out_and_grads(_reference(window), q, k, v, w, seg, pos)
  _assert_as_accurate(got, bf16, exact)


@pytest.mark.parametrize(
  "dtype,head_dim,length,window,cap,message",
  [
    (jnp.bfloat16, 64, 256, 0, 50.0, r"no logit soft cap \(attn_logits_soft_cap=50.0, Gemma 2\)"),
    (jnp.bfloat16, 64, 256, "traced", 0.0, r"fixed sliding window"),
    (jnp.float32, 64, 256, 0, 0.0, r"bfloat16 or float16 inputs, not float32"),
    (jnp.bfloat16, 320, 256, 0, 0.0, r"head_dim .* not 320"),
    (jnp.bfloat16, 60, 256, 0, 0.0, r"head_dim .* not 60"),
    (jnp.bfloat16, 64, 255, 0, 0.0, r"even length, not 255"),
    (jnp.bfloat16, 64, 256, 0, 0.0, r"NVIDIA GPUs only, not on cpu"),
  ],
)
@pytest.mark.parametrize("name", ["cudnn_flash_jax", "cudnn_flash_te"])
def test_cudnn_refuses_what_it_cannot_do(name, dtype, head_dim, length, window, cap, message):
  """One line naming the limit and the alternatives; the feature limits come before the platform's."""
  cfg = _config(attention=name)
  q = jnp.zeros((1, length, 2, head_dim), dtype)
  ids = jnp.zeros((1, length), jnp.int32)

  def call(window):
    return ak.attend(q, q, q, ids, ids, AttentionSettings.from_config(cfg, window=window, cap=cap), mesh=None)

  with pytest.raises(ValueError) as error:
    if window == "traced":
      jax.jit(call).lower(jnp.asarray(4, jnp.int32))
    else:
      call(window)
  # The first line is ours (under jit JAX appends a note on its filtered traceback after it).
  pattern = rf"attention={name}: cuDNN fused attention .*{message}.*; use attention=flash or attention=dot_product"
  assert re.fullmatch(pattern, str(error.value).splitlines()[0]), str(error.value)


# ------------------------------------------------------------------------------------------ choice and dispatch


def test_select():
  cfg = _config()
  long, short = 4096, 512
  assert ak.select(cfg, long, "tpu") == "flash"
  assert ak.select(cfg, short, "tpu") == "flash"  # splash whenever the length fits its blocks
  assert ak.select(cfg, 200, "tpu") == "dot_product"  # not a multiple of 128
  assert ak.select(cfg, long, "cpu") == "flash"
  assert ak.select(cfg, short, "cpu") == "dot_product"
  assert ak.select(cfg, short, "gpu") == "dot_product"
  bf16 = {"q_shape": (1, long, 8, 128), "dtype": jnp.bfloat16}
  assert ak.select(cfg, long, "gpu", **bf16) == "cudnn_flash_jax"
  assert ak.select(cfg, long, "cuda", **bf16, window=4096) == "cudnn_flash_jax"
  assert ak.select(cfg, long, "gpu", **bf16, cap=50.0) == "flash"
  assert ak.select(cfg, long, "gpu", q_shape=bf16["q_shape"], dtype=jnp.float32) == "flash"
  for name in ak.KERNELS[1:]:
    assert ak.select(_config(attention=name), short, "cpu") == name  # explicit choices stand
  with pytest.raises(ValueError, match=r"attention=splash is not one of autoselected, dot_product"):
    ak.select(_config(attention="splash"), long, "cpu")


@pytest.mark.parametrize(
  "attention,length,called",
  [
    ("flash", 64, "blockwise"),
    ("autoselected", 2048, "blockwise"),
    ("autoselected", 64, "dot"),
    ("dot_product", 2048, "dot"),
  ],
)
def test_attend_dispatches_on_the_cpu(monkeypatch, attention, length, called):
  """attend() runs the kernel select() names, with the config's blocks and precision (kernels stubbed)."""
  calls = []
  monkeypatch.setattr(ak, "blockwise_attention", lambda *a: calls.append(("blockwise", a[5])) or a[0])
  monkeypatch.setattr(ak, "dot_product_attention", lambda *a: calls.append(("dot", a[5])) or a[0])
  q = jax.ShapeDtypeStruct((1, length, 2, 8), jnp.float32)
  ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
  cfg = _config(attention=attention, sa_block_q=256, sa_block_kv=64)
  jax.eval_shape(lambda q, ids: ak.attend(q, q, q, ids, ids, AttentionSettings.from_config(cfg, window=5, cap=2.0)), q, ids)
  assert [c[0] for c in calls] == [called]
  settings = calls[0][1]
  if called == "blockwise":
    assert (settings.block_q, settings.block_kv) == (256, 64)
  assert (settings.precision, settings.window, settings.cap) == (HIGHEST, 5, 2.0)

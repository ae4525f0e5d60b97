"""Attention kernels against the reference `dot_product_attention`: outputs and gradients, on the CPU.

Every comparison runs both sides on the same float32 inputs at HIGHEST matmul precision (the reference with float32
scores, F32_SCORES, which float32 inputs give anyway), over GQA, packed documents with padding, sliding windows
(static and traced), soft caps and lengths that are not a multiple of the block. The gradient is that of
sum(out * w) for a fixed random w, with respect to q, k and v (and the sinks). Chunked attention and attention
sinks are also checked against a float64 NumPy reference written out here. Splash runs in Pallas interpret mode;
cuDNN's numerics need a GPU (skipped here), but its argument plumbing runs through `jax.nn.dot_product_attention`'s
XLA path, and its refusals are checked on the CPU. dot_product's own score dtype (MaxText's float32_qk_product and
float32_logits) is checked in bf16 against float64.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh

from MaxText.common_types import ConfigError
from MaxText.layers import attention_kernels as ak
from MaxText.layers import attention_splash
from MaxText.layers.attention_kernels import AttentionSettings
from MaxText.layers.attention_masks import dense_scores
from MaxText.tests.helpers import BASE_YML

HIGHEST = jax.lax.Precision.HIGHEST
# Measured float32 errors against the reference (max abs, values O(1)): blockwise ~6e-7 forward, ~3e-6 gradients;
# splash ~6e-7 and ~3e-6. Both are reorderings of float32 sums over <= 256 keys, whose rounding is a few 1e-7
# relative; the bounds leave ~3x headroom and stay 100x below any masking or scaling error (>= 1e-3).
FWD_ATOL, GRAD_ATOL = 2e-6, 1e-5
# dot_product as the reference: float32 scores and softmax whatever the inputs' dtype (MaxText's keys; with the
# defaults, false, bf16 inputs would give bf16 scores, a weaker reference than the kernels it judges).
F32_SCORES = {"float32_qk_product": True, "float32_logits": True}


def _config(**overrides):
  """The fields the kernels read, at base.yml's defaults, with 128-token splash blocks for short test lengths."""
  with open(BASE_YML, encoding="utf-8") as f:
    base = yaml.safe_load(f)
  values = {name: value for name, value in base.items() if name.startswith(("sa_", "float32_"))}
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
  settings = AttentionSettings(window=window, cap=cap, precision=HIGHEST, **F32_SCORES)
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
    return ak.dot_product_attention(q, k, v, seg, pos, AttentionSettings(window, precision=HIGHEST, **F32_SCORES))

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


# ------------------------------------------------------------------------------------------- chunks and sinks
# Against an independent float64 NumPy reference: the masks and the sink softmax written out here, and gradients by
# central differences of it. Every kernel's chunk and sink test below compares with it or with dot_product, which
# test_dot_product_matches_numpy checks against it.


def _numpy_attention(q, k, v, seg, pos, sinks=None, **masks):
  """float64 causal GQA attention: query i of head h sees key j <= i of its segment with pos_i - pos_j < window
  (window > 0) and pos_i // chunk == pos_j // chunk (chunk > 0); logits soft-capped by cap (> 0); softmax over those
  keys and, with sinks, one more logit sinks[h] that has no value (gpt-oss): exp(l_j) / (sum_j' exp(l_j') +
  exp(sinks[h])). masks: window, chunk, cap (each 0 when absent)."""
  window, chunk, cap = (masks.get(name, 0) for name in ("window", "chunk", "cap"))
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seg, pos = np.asarray(seg), np.asarray(pos)
  length, group = q.shape[1], q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # query head h reads kv head h // group
  logits = np.einsum("bqhd,bkhd->bhqk", q, k)
  if cap > 0:
    logits = cap * np.tanh(logits / cap)
  index = np.arange(length)
  visible = (index[:, None] >= index[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
  if window > 0:
    visible &= pos[:, :, None] - pos[:, None, :] < window
  if chunk > 0:
    visible &= pos[:, :, None] // chunk == pos[:, None, :] // chunk
  logits = np.where(visible[:, None], logits, -np.inf)  # every query sees itself, so no row is empty
  sink = np.full(q.shape[2], -np.inf) if sinks is None else np.asarray(sinks, np.float64)
  top = np.maximum(logits.max(axis=-1), sink[None, :, None])
  weights = np.exp(logits - top[..., None])
  weights /= (weights.sum(axis=-1) + np.exp(sink[None, :, None] - top))[..., None]
  return np.einsum("bhqk,bkhd->bqhd", weights, v)


def _numpy_directional_grads(loss, inputs, rng, eps=1e-5):
  """{name: (u, d loss(x + t u) / dt at t=0)} for each float64 input and a random unit direction u, by central
  differences (error ~eps^2 times the third derivative: far below float32's)."""
  out = {}
  for name, x in inputs.items():
    u = rng.standard_normal(np.shape(x))
    u /= np.linalg.norm(u)
    plus = loss(**{**inputs, name: x + eps * u})
    minus = loss(**{**inputs, name: x - eps * u})
    out[name] = (u, (plus - minus) / (2 * eps))
  return out


def _out_and_all_grads(attention, q, k, v, sinks, w, *args):
  """(attention(q, k, v, sinks, *args), d/d(q, k, v, sinks) of sum(out * w)), in one compiled function."""

  def run(q, k, v, sinks, w, *args):
    out, vjp = jax.vjp(lambda q, k, v, sinks: attention(q, k, v, sinks, *args), q, k, v, sinks)
    return out, vjp(w.astype(out.dtype))

  return jax.jit(run)(q, k, v, sinks, w, *args)


def _assert_all_close(got, want, fwd_atol=FWD_ATOL, grad_atol=GRAD_ATOL):
  np.testing.assert_allclose(got[0], want[0], atol=fwd_atol, rtol=0, err_msg="output")
  for name, g, r in zip(("q", "k", "v", "sinks"), got[1], want[1], strict=True):
    np.testing.assert_allclose(g, r, atol=grad_atol, rtol=0, err_msg=f"d{name}")


def _sinks(heads):
  """Sink logits around the logits' scale, so the sinks take a real share of each softmax (up to ~0.8 early on)."""
  return jax.random.normal(jax.random.key(7), (heads,), jnp.float32) + 1.0


def _settings_reference(window=0, chunk=0):
  """dot_product with sinks as an argument: (q, k, v, sinks, seg, pos) -> out."""

  def attention(q, k, v, sinks, seg, pos):
    settings = AttentionSettings(window, chunk, sinks, precision=HIGHEST, **F32_SCORES)
    return ak.dot_product_attention(q, k, v, seg, pos, settings)

  return attention


def _assert_matches_numpy(got, q, k, v, sinks, w, seg, pos, **masks):
  """got = (out, (dq, dk, dv, dsinks)) of sum(out * w): out within FWD_ATOL of the float64 reference, and each
  gradient's derivative along a random direction within 1e-5 relative to the gradient's norm (float32 sums over
  ~1e3 terms of O(1), each rounded ~6e-8 relative: measured below 1e-6)."""
  inputs = {name: np.asarray(x, np.float64) for name, x in zip(("q", "k", "v", "sinks"), (q, k, v, sinks), strict=True)}
  np.testing.assert_allclose(got[0], _numpy_attention(**inputs, seg=seg, pos=pos, **masks), atol=FWD_ATOL, rtol=0)
  w64 = np.asarray(w, np.float64)

  def loss(**x):
    return (_numpy_attention(**x, seg=seg, pos=pos, **masks) * w64).sum()

  directional = _numpy_directional_grads(loss, inputs, np.random.default_rng(0))
  for (name, (u, want)), grad in zip(directional.items(), got[1], strict=True):
    along = (np.asarray(grad, np.float64) * u).sum()
    assert abs(along - want) <= 1e-5 * np.linalg.norm(grad), (name, along, want)


@pytest.mark.parametrize(
  "window,chunk,sinks,cap",
  [(0, 8, False, 0.0), (5, 8, True, 0.0), (0, 0, True, 3.0), (0, 6, True, 0.0)],
)
def test_dot_product_matches_numpy(window, chunk, sinks, cap):
  """The reference itself (its chunk mask and sink softmax, the lead's) against the float64 NumPy one."""
  q, k, v, _, seg, pos = _inputs(2, 37, 4, 2)
  sink = _sinks(4) if sinks else None
  settings = AttentionSettings(window, chunk, sink, cap, precision=HIGHEST)
  got = ak.dot_product_attention(q, k, v, seg, pos, settings)
  want = _numpy_attention(q, k, v, seg, pos, sink, window=window, chunk=chunk, cap=cap)
  np.testing.assert_allclose(got, want, atol=FWD_ATOL, rtol=0)


@pytest.mark.parametrize(
  "heads,kv_heads,block_q,block_kv,window,chunk",
  [
    (4, 2, 4, 1, 0, 8),  # GQA, one key per block: a key block skipped one token too close would show
    (6, 2, 8, 16, 5, 12),  # groups of 3, a window inside the chunk, chunks across blocks
    (4, 1, 16, 16, 0, 0),  # MQA, sinks alone
  ],
)
def test_blockwise_chunks_and_sinks_match_numpy(heads, kv_heads, block_q, block_kv, window, chunk):
  """Length 37, two documents and padding in row 0 (so chunks restart inside the row), with sinks: output and the
  gradients of q, k, v and the sinks against the float64 reference, and elementwise against dot_product's."""
  q, k, v, w, seg, pos = _inputs(2, 37, heads, kv_heads)
  sinks = _sinks(heads)

  def blockwise(q, k, v, sinks, seg, pos):
    settings = AttentionSettings(window, chunk, sinks, precision=HIGHEST, block_q=block_q, block_kv=block_kv)
    return ak.blockwise_attention(q, k, v, seg, pos, settings)

  got = _out_and_all_grads(blockwise, q, k, v, sinks, w, seg, pos)
  _assert_matches_numpy(got, q, k, v, sinks, w, seg, pos, window=window, chunk=chunk)
  _assert_all_close(got, _out_and_all_grads(_settings_reference(window, chunk), q, k, v, sinks, w, seg, pos))


def test_blockwise_traced_chunk_and_sinks_in_scan():
  """Llama 4's pattern (chunked layers and a global one in one scan, the chunk a traced scan input) with gpt-oss's
  sinks, per layer: blockwise equals the reference, and the chunk and sinks mattered."""
  q, k, v, w, seg, pos = _inputs(1, 48, 2, 1, docs=(30,))
  sinks = jnp.stack([_sinks(2), -_sinks(2)])

  def layers(attention, chunks):
    def run(q, k, v, sinks, seg, pos):
      def layer(x, chunk_and_sinks):
        out = attention(x, k, v, seg, pos, *chunk_and_sinks)
        return out, out

      return jax.lax.scan(layer, q, (jnp.asarray(chunks, jnp.int32), sinks))[1].sum(0)

    return run

  def blockwise(q, k, v, seg, pos, chunk, sinks):
    settings = AttentionSettings(chunk=chunk, sinks=sinks, precision=HIGHEST, block_q=16, block_kv=8)
    return ak.blockwise_attention(q, k, v, seg, pos, settings)

  def reference(q, k, v, seg, pos, chunk, sinks):
    settings = AttentionSettings(chunk=chunk, sinks=sinks, precision=HIGHEST, **F32_SCORES)
    return ak.dot_product_attention(q, k, v, seg, pos, settings)

  want = _out_and_all_grads(layers(reference, [8, 0]), q, k, v, sinks, w, seg, pos)
  _assert_all_close(_out_and_all_grads(layers(blockwise, [8, 0]), q, k, v, sinks, w, seg, pos), want)
  unchunked = _out_and_all_grads(layers(reference, [0, 0]), q, k, v, sinks, w, seg, pos)
  assert np.abs(np.asarray(want[0]) - unchunked[0]).max() > 1e-2
  assert np.abs(np.asarray(want[1][3])).min() > 1e-3  # every sink has a gradient


def test_decode_step_with_chunks_and_sinks_equals_the_full_forward():
  """attentions.cached_attention (one new token against the cache) for a chunked layer with sinks gives the full
  forward's last position, for every row (row 0 ends in padding, row 1 in one document)."""
  from MaxText.layers.attentions import cached_attention

  q, k, v, _, seg, pos = _inputs(2, 29, 4, 2, docs=(10, 12))
  settings = AttentionSettings(window=0, chunk=8, sinks=_sinks(4), precision=HIGHEST)
  full = jax.jit(lambda q, k, v, seg, pos: ak.dot_product_attention(q, k, v, seg, pos, settings))(q, k, v, seg, pos)
  # The cache holds the earlier tokens of the last token's own document (cache_mask), as the decoder keeps them.
  cache_mask = seg[:, :-1] == seg[:, -1:]

  @jax.jit
  def step(q, k, v, cache, cache_mask, pos, cache_pos):
    return cached_attention(q, k, v, cache, cache_mask, settings, pos, cache_pos)

  got = step(q[:, -1:], k[:, -1:], v[:, -1:], (k[:, :-1], v[:, :-1]), cache_mask, pos[:, -1:], pos[:, :-1])
  np.testing.assert_allclose(got[:, 0], full[:, -1], atol=FWD_ATOL, rtol=0)
  want = _numpy_attention(q, k, v, seg, pos, settings.sinks, chunk=8)[:, -1]
  np.testing.assert_allclose(got[:, 0], want, atol=FWD_ATOL, rtol=0)


# ------------------------------------------------------------------------- score dtype (float32_qk_product, float32_logits)
# MaxText's keys for the dense kernels: both false (the default), bf16 activations give bf16 scores and a bf16 softmax;
# float32_qk_product computes q.k in float32, float32_logits casts the scores to float32 before the softmax. Checked
# against the float64 product and attention of the same bf16 values, with bounds that follow from bf16's unit
# roundoff U = 2**-8 (8 significant bits, round to nearest) and float32 accumulation (d terms: d * 2**-24 * sum |q k|).
U = 2.0**-8
KEY_SETTINGS = [(False, False), (False, True), (True, False), (True, True)]


def _scaled_bf16(batch=2, length=37, heads=4, kv_heads=2, docs=(10, 15)):
  """bf16 inputs whose logits reach ~20 (q 4x _inputs'), so bf16 rounding of a score (up to 0.08) shows."""
  q, k, v, w, seg, pos = _inputs(batch, length, heads, kv_heads, docs=docs, dtype=jnp.bfloat16)
  return (q * 4).astype(jnp.bfloat16), k, v, w, seg, pos


@pytest.mark.parametrize("qk,logits", KEY_SETTINGS)
def test_dense_scores_follow_the_keys(qk, logits):
  """attention_masks.dense_scores of bf16 q, k: with float32_qk_product float32 scores within float32 accumulation
  error of the exact product (bf16 x bf16 products are exact in float32), which rules out any bf16 rounding (up to
  U relative); without it the product rounded once to bf16 (within U relative plus that accumulation error, every
  value a bf16 number, and some really rounded), in bf16, or in float32 with float32_logits."""
  q, k, *_ = _scaled_bf16()
  k = jnp.repeat(k, 2, axis=2)  # one kv head per query head: the plain "bthd,bshd" product
  settings = AttentionSettings(float32_qk_product=qk, float32_logits=logits)
  got = dense_scores("bthd,bshd->bhts", q, k, settings)
  assert got.dtype == (jnp.float32 if qk or logits else jnp.bfloat16)
  q64, k64 = np.asarray(q, np.float64), np.asarray(k, np.float64)
  exact = np.einsum("bthd,bshd->bhts", q64, k64)
  accumulation = q.shape[-1] * 2.0**-24 * np.einsum("bthd,bshd->bhts", np.abs(q64), np.abs(k64))
  err = np.abs(np.asarray(got, np.float64) - exact)
  assert np.abs(exact).max() > 15  # scores large enough for bf16 rounding to matter
  if qk:
    assert (err <= accumulation).all(), err.max()
    return
  assert (err <= U * np.abs(exact) + accumulation).all(), (err / np.abs(exact)).max()
  as_bf16 = np.asarray(got.astype(jnp.bfloat16), np.float64)
  np.testing.assert_array_equal(np.asarray(got, np.float64), as_bf16)
  assert (err > accumulation).mean() > 0.5  # most scores were rounded


@pytest.mark.parametrize("qk,logits", KEY_SETTINGS)
def test_dot_product_score_dtype_against_float64(qk, logits):
  """dot_product on bf16 inputs (GQA, packed documents) against float64 attention of the same values, element by
  element: |out - ref| <= rel * sum_s w_s |v_s| + U |ref|, rel = exp(2 eta) (1 + U)^4 - 1, where eta bounds a
  score's own error (a shift common to a row cancels in the softmax): float32 scores, eta = 0; bf16 scores, eta =
  U S (S = the largest |score|); bf16 scores and a bf16 softmax, eta = 3 U S (the subtraction of the row maximum
  rounds too); the (1 + U)^4 and U |ref| are bf16's rounding of exp, sum, division or weights, and of the output.
  With bf16 scores the error also exceeds the float32-score bound somewhere: the keys do what they say."""
  q, k, v, _, seg, pos = _scaled_bf16()
  settings = AttentionSettings(precision=HIGHEST, float32_qk_product=qk, float32_logits=logits)
  got = np.asarray(jax.jit(ak.dot_product_attention, static_argnums=5)(q, k, v, seg, pos, settings), np.float64)
  ref = _numpy_attention(q, k, v, seg, pos)
  weighted = _numpy_attention(q, k, jnp.abs(v), seg, pos)  # sum_s w_s |v_s|: the weights are >= 0
  q64, k64 = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 2, axis=2)
  largest = np.abs(np.einsum("bthd,bshd->bhts", q64, k64)).max()

  def bound(eta):
    return (np.exp(2 * eta) * (1 + U) ** 4 - 1) * weighted + U * np.abs(ref)

  eta = 0.0 if qk else (U if logits else 3 * U) * largest
  err = np.abs(got - ref)
  assert (err <= bound(eta)).all(), (err - bound(eta)).max()
  if not qk:
    assert (err > bound(0.0)).any(), "bf16 scores should be less accurate than float32 ones"


@pytest.mark.parametrize("qk,logits", KEY_SETTINGS[1:])
def test_float32_activations_ignore_the_keys(qk, logits):
  """dtype=float32: the scores are float32 whatever the keys say, so outputs and gradients are bit for bit the
  defaults'."""
  q, k, v, w, seg, pos = _inputs(2, 37, 4, 2)

  def attention(settings):
    return lambda q, k, v, seg, pos: ak.dot_product_attention(q, k, v, seg, pos, settings)

  want = _out_and_grads(attention(AttentionSettings()), q, k, v, w, seg, pos)
  got = _out_and_grads(attention(AttentionSettings(float32_qk_product=qk, float32_logits=logits)), q, k, v, w, seg, pos)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(g, r)


def test_decode_follows_the_keys_as_the_full_forward_does():
  """bf16, a chunked layer with sinks: a decode step (attentions.cached_attention) with the keys off gives the full
  forward's last position with them off, and with them on the full forward's with them on, within 3 U sum_s w_s
  |v_s| (the step rounds its cache and new-token parts and their sum to bf16, the forward its one sum); the two
  settings differ by more than that, so a decode path that ignored the keys would fail here."""
  from MaxText.layers.attentions import cached_attention

  q, k, v, _, seg, pos = _scaled_bf16(length=29, docs=(10, 12))
  cache_mask = seg[:, :-1] == seg[:, -1:]
  sinks = _sinks(4)
  weighted = _numpy_attention(q, k, jnp.abs(v), seg, pos, sinks, chunk=8)[:, -1]  # sum_s w_s |v_s|
  outs = {}
  for keys in ({}, F32_SCORES):
    settings = AttentionSettings(chunk=8, sinks=sinks, precision=HIGHEST, **keys)
    full = jax.jit(lambda q, k, v, seg, pos, s=settings: ak.dot_product_attention(q, k, v, seg, pos, s))
    step = jax.jit(lambda q, k, v, cache, mask, p, cp, s=settings: cached_attention(q, k, v, cache, mask, s, p, cp))
    want = np.asarray(full(q, k, v, seg, pos)[:, -1], np.float64)
    got = np.asarray(step(q[:, -1:], k[:, -1:], v[:, -1:], (k[:, :-1], v[:, :-1]), cache_mask, pos[:, -1:], pos[:, :-1]))
    assert (np.abs(got[:, 0] - want) <= 3 * U * weighted).all(), (bool(keys), np.abs(got[:, 0] - want).max())
    outs[bool(keys)] = want
  assert (np.abs(outs[True] - outs[False]) > 3 * U * weighted).any()


def test_the_keys_change_no_other_kernel():
  """Blockwise, splash and cuDNN keep float32 scores and softmax statistics in their tiles: with bf16 inputs the
  keys leave what they compute unchanged (the same jaxpr, keys on and off)."""
  q, k, v, _, seg, pos = _inputs(1, 256, 2, 1, docs=(150,), dtype=jnp.bfloat16)
  cfg = _config()

  def kernels(keys):
    on = AttentionSettings.from_config(cfg, interpret=True, **keys)
    return {
      "blockwise": lambda q, k, v, seg, pos: ak.blockwise_attention(q, k, v, seg, pos, on),
      "splash": lambda q, k, v, seg, pos: ak.splash_attention(q, k, v, seg, pos, on),
      "cudnn": lambda q, k, v, seg, pos: ak.cudnn_attention(q, k, v, seg, pos, on, implementation="xla"),
    }

  off, on = kernels({}), kernels(F32_SCORES)
  for name in off:
    assert str(jax.make_jaxpr(off[name])(q, k, v, seg, pos)) == str(jax.make_jaxpr(on[name])(q, k, v, seg, pos)), name


def test_the_keys_reach_the_kernels_from_the_config():
  """base.yml's defaults are MaxText's (false, false); set on the command line, AttentionSettings.from_config
  carries them to the kernels."""
  from MaxText.tests.helpers import config

  default = AttentionSettings.from_config(config())
  assert (default.float32_qk_product, default.float32_logits) == (False, False)
  both = AttentionSettings.from_config(config("float32_qk_product=true", "float32_logits=true"))
  assert (both.float32_qk_product, both.float32_logits) == (True, True)


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
    want = ak.dot_product_attention(q, k, v, seg, pos, AttentionSettings(window, precision=HIGHEST, **F32_SCORES))
    got = splash(q, k, v, seg, pos, jnp.asarray(window, jnp.int32))
    np.testing.assert_allclose(got, want, atol=FWD_ATOL, rtol=0, err_msg=f"window={window}")


@pytest.mark.parametrize(
  "kv_heads,window,chunk,traced",
  [
    (2, 0, 48, False),  # GQA, a python chunk (also bounding the local mask), sinks
    (1, 40, 64, True),  # MQA, a window inside a traced chunk
  ],
)
def test_splash_chunks_and_sinks_match_dot_product(kv_heads, window, chunk, traced):
  """Interpret mode, length 256, three documents and padding in row 0 (chunks restart inside the row, off splash's
  blocks): output and the gradients of q, k, v and the sinks (splash's own sinks input) equal the reference's."""
  cfg = _config(sliding_window_size=window)
  q, k, v, w, seg, pos = _inputs(2, 256, 4, kv_heads, docs=(100, 30, 106))
  sinks = _sinks(4)

  def splash(q, k, v, sinks, seg, pos, chunk):
    settings = AttentionSettings.from_config(cfg, window=window, chunk=chunk, sinks=sinks, interpret=True)
    return ak.splash_attention(q, k, v, seg, pos, settings)

  got = (
    _out_and_all_grads(splash, q, k, v, sinks, w, seg, pos, jnp.int32(chunk))
    if traced
    else _out_and_all_grads(lambda *a: splash(*a, chunk), q, k, v, sinks, w, seg, pos)
  )
  _assert_all_close(got, _out_and_all_grads(_settings_reference(window, chunk), q, k, v, sinks, w, seg, pos))


def test_splash_sinks_in_bfloat16_under_a_traced_window_keep_a_float32_gradient():
  """bfloat16 activations, float32 sinks, a traced window (the switch between splash's causal and local kernels and
  blockwise): splash returns the sinks' gradient in bfloat16, which the switch refused when gpt-oss-120b was compiled
  for TPU; it comes back float32 and equals the reference's within bfloat16's precision."""
  cfg = _config(sliding_window_size=40)
  q, k, v, w, seg, pos = _inputs(1, 256, 2, 1, docs=(150,), dtype=jnp.bfloat16)
  sinks = _sinks(2)

  def loss(attention, sinks, window):
    return jnp.sum(attention(q, k, v, sinks, seg, pos, window).astype(jnp.float32) * w)

  def splash(q, k, v, sinks, seg, pos, window):
    settings = AttentionSettings.from_config(cfg, window=window, sinks=sinks, interpret=True)
    return ak.splash_attention(q, k, v, seg, pos, settings)

  def reference(q, k, v, sinks, seg, pos, window):
    return ak.dot_product_attention(q, k, v, seg, pos, AttentionSettings(window, 0, sinks, precision=HIGHEST, **F32_SCORES))

  for window in (40, 0):
    got = jax.jit(jax.grad(functools.partial(loss, splash)))(sinks, jnp.int32(window))
    want = jax.grad(functools.partial(loss, reference))(sinks, window)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(want))), err_msg=f"{window=}")


def test_splash_refuses_sinks_it_does_not_have(monkeypatch):
  """With a jax whose splash has no sinks input: attention=flash refuses in one line, autoselected takes
  dot_product on TPU."""
  monkeypatch.setattr(ak, "splash_takes_sinks", lambda: False)
  monkeypatch.setattr(attention_splash, "splash_takes_sinks", lambda: False)
  cfg = _config(attention="flash")
  q = jnp.zeros((1, 256, 2, 8))
  ids = jnp.zeros((1, 256), jnp.int32)
  settings = AttentionSettings.from_config(cfg, sinks=jnp.zeros(2), interpret=True)
  with pytest.raises(ConfigError) as error:
    ak.splash_attention(q, q, q, ids, ids, settings)
  assert re.fullmatch(r"attention=flash \(splash\): .*no attention sinks.*; use attention=dot_product.*", str(error.value))
  assert ak.select(_config(), 256, "tpu", sinks=settings.sinks) == "dot_product"
  assert ak.select(_config(), 256, "tpu") == "flash"


@pytest.mark.mesh  # 4 devices
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


@pytest.mark.mesh  # 4 devices
def test_splash_chunks_and_sinks_under_shard_map():
  """As test_splash_under_shard_map, with a chunk (traced) and sinks: each device holds its heads' sinks, and their
  gradient sums over the devices that split the batch."""
  cfg = _config()
  shape = [2 if axis in ("data", "tensor") else 1 for axis in cfg.mesh_axes]
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(shape), cfg.mesh_axes)
  q, k, v, w, seg, pos = _inputs(2, 256, 4, 2, docs=(100, 30, 106))
  sinks = _sinks(4)

  def splash(q, k, v, sinks, seg, pos, chunk):
    settings = AttentionSettings.from_config(cfg, window=40, chunk=chunk, sinks=sinks, interpret=True)
    return ak.splash_attention(q, k, v, seg, pos, settings, mesh)

  got = _out_and_all_grads(splash, q, k, v, sinks, w, seg, pos, jnp.int32(64))
  _assert_all_close(got, _out_and_all_grads(_settings_reference(40, 64), q, k, v, sinks, w, seg, pos))


def test_splash_refuses_lengths_that_do_not_fit_its_blocks():
  with pytest.raises(ValueError, match=r"length 200 .*use attention=dot_product"):
    ak.splash_block_sizes(_config(), 200)
  with pytest.raises(ValueError, match=r"sa_block_kv=192"):
    ak.splash_block_sizes(_config(sa_block_kv=192), 256)
  assert ak.splash_block_sizes(_config(sa_block_q=512), 256).block_q == 256  # clipped to the length


# ----------------------------------------------------------------------------------------------------- cuDNN


@pytest.mark.parametrize("window,chunk", [(0, 0), (7, 0), (5, 8)])
def test_cudnn_call_through_xla(window, chunk):
  """The exact jax.nn.dot_product_attention call of the cuDNN path (document mask, causal flag, window, GQA,
  scale 1; chunks inside the document mask), run by its XLA implementation: equal to the float64 reference. Packed
  rows, so the mask matters."""
  q, k, v, _, seg, pos = _inputs(2, 36, 4, 2)
  settings = AttentionSettings(window, chunk)
  cudnn = jax.jit(lambda q, k, v, seg, pos: ak.cudnn_attention(q, k, v, seg, pos, settings, implementation="xla"))
  want = _numpy_attention(q, k, v, seg, pos, window=window, chunk=chunk)
  np.testing.assert_allclose(cudnn(q, k, v, seg, pos), want, atol=FWD_ATOL, rtol=0)


@pytest.mark.parametrize("window", [0, 7])
def test_cudnn_matches_dot_product_on_gpu(window):
  """bf16 inputs: cuDNN's error against a float32 reference is at most 1.5x dot_product's in bf16 (+1e-3)."""
  if jax.devices()[0].platform != "gpu":  # asked here, not at import: conftest sets the device count after collection
    pytest.skip("cuDNN fused attention needs an NVIDIA GPU")
  q, k, v, w, seg, pos = _inputs(2, 256, 4, 2, head_dim=64, docs=(100, 30, 106), dtype=jnp.bfloat16)
  exact = _out_and_grads(_reference(window), *[x.astype(jnp.float32) for x in (q, k, v)], w, seg, pos)
  settings = AttentionSettings(window)
  got = _out_and_grads(lambda q, k, v, seg, pos: ak.cudnn_attention(q, k, v, seg, pos, settings), q, k, v, w, seg, pos)
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
    (jnp.bfloat16, 64, 256, 0, "sinks", r"no attention sinks \(gpt-oss's learned sink logit per head\)"),
  ],
)
@pytest.mark.parametrize("name", ["cudnn_flash_jax", "cudnn_flash_te"])
def test_cudnn_refuses_what_it_cannot_do(name, dtype, head_dim, length, window, cap, message):
  """One line naming the limit and the alternatives; the feature limits come before the platform's."""
  cfg = _config(attention=name)
  q = jnp.zeros((1, length, 2, head_dim), dtype)
  ids = jnp.zeros((1, length), jnp.int32)
  features = {"sinks": jnp.zeros(2)} if cap == "sinks" else {"cap": cap}

  def call(window):
    return ak.attend(q, q, q, ids, ids, AttentionSettings.from_config(cfg, window=window, **features), mesh=None)

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
  sinks = jnp.zeros(8)
  assert ak.select(cfg, long, "gpu", **bf16, sinks=sinks) == "flash"  # cuDNN has none: blockwise
  assert ak.select(cfg, long, "tpu", sinks=sinks) == "flash"  # this jax's splash takes them
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

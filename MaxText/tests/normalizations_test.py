"""RMSNorm and LayerNorm (layers/normalizations.py) against their formulas in float64 numpy: float32 and bfloat16
activations, Gemma's scale stored as an offset from 1, and the epsilon of the config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText.layers.normalizations import LayerNorm, RMSNorm
from MaxText.tests.helpers import config


def _apply(layer, params, x):
  return np.asarray(layer.apply({"params": params}, x).astype(jnp.float32), np.float64)


def _inputs(dtype, shape=(2, 3, 16), seed=0):
  x = np.random.default_rng(seed).normal(size=shape) * 3 + 0.5
  return jnp.asarray(x, dtype), np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rmsnorm_equals_its_formula_in_float64(dtype, rtol, offset):
  cfg = config(f"dtype={dtype}", "weight_dtype=float32", "normalization_layer_epsilon=1e-3")
  layer = RMSNorm(cfg, scale_offset=offset)
  x, x64 = _inputs(jnp.dtype(dtype))
  params = nn.meta.unbox(layer.init(jax.random.key(0), x)["params"])
  # A scale of the init's kind: ones, or zeros stored as offsets from 1 (Gemma): both mean a gain of 1.
  assert np.all(np.asarray(params["scale"]) == (0.0 if offset else 1.0))
  scale = np.random.default_rng(1).normal(size=16)
  params = {"scale": jnp.asarray(scale, jnp.float32)}
  want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-3) * (offset + scale)
  got = _apply(layer, params, x)
  assert layer.apply({"params": params}, x).dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_layernorm_equals_its_formula_in_float64(dtype, rtol):
  cfg = config(f"dtype={dtype}", "weight_dtype=float32", "normalization_layer_epsilon=1e-5")
  layer = LayerNorm(cfg)
  x, x64 = _inputs(jnp.dtype(dtype))
  params = nn.meta.unbox(layer.init(jax.random.key(0), x)["params"])
  assert np.all(np.asarray(params["scale"]) == 1) and np.all(np.asarray(params["bias"]) == 0)
  rng = np.random.default_rng(2)
  scale, bias = rng.normal(size=16), rng.normal(size=16)
  params = {"scale": jnp.asarray(scale, jnp.float32), "bias": jnp.asarray(bias, jnp.float32)}
  centred = x64 - x64.mean(axis=-1, keepdims=True)
  want = centred / np.sqrt((centred**2).mean(axis=-1, keepdims=True) + 1e-5) * scale + bias
  got = _apply(layer, params, x)
  assert layer.apply({"params": params}, x).dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_the_epsilon_of_the_config_is_the_one_used():
  """An all-zero row normalises to 0 whatever epsilon is; a row of tiny values shows it: x / sqrt(x^2 + eps)."""
  x = jnp.full((1, 4), 1e-3, jnp.float32)
  for eps in (1e-6, 1e-2):
    layer = RMSNorm(config("normalization_layer_epsilon=" + str(eps)))
    got = np.asarray(layer.apply({"params": {"scale": jnp.ones(4)}}, x))
    np.testing.assert_allclose(got, 1e-3 / np.sqrt(1e-6 + eps), rtol=1e-6)

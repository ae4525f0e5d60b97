"""layers/grouped_matmul.py: the tiled CPU grouped matmul against jax.lax.ragged_dot (exact matmuls, float32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.layers.grouped_matmul import Tiles, megablox_grouped_matmul, tile_rows, tiled_grouped_matmul


def _ragged_dot(x, w, group_sizes):
  return jax.lax.ragged_dot(x, w, group_sizes, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize(
  "sizes, tile",
  [
    ([5, 0, 17, 3, 10], 4),  # an empty group, groups over several tiles, partial tiles
    ([0, 0, 37, 0, 0], 8),  # one group holds every row
    ([3, 4, 2], 16),  # 31 rows, only 9 in groups: the rest give zeros; every group within one tile
  ],
)
def test_tiled_equals_ragged_dot_forward_and_gradients(sizes, tile):
  """Outputs and the gradients of x and w equal ragged_dot's to float32 rounding (1e-6 of the largest value)."""
  rng = np.random.default_rng(len(sizes) * tile)
  rows = 31 if sum(sizes) < 31 else sum(sizes) + 3
  x = jnp.asarray(rng.standard_normal((rows, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((len(sizes), 8, 6)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def weighted(matmul):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w) * dy), (0, 1)))(x, w)

  got = weighted(lambda x, w: tiled_grouped_matmul(x, w, group_sizes, tile))
  want = weighted(lambda x, w: _ragged_dot(x, w, group_sizes))
  np.testing.assert_allclose(tiled_grouped_matmul(x, w, group_sizes, tile)[sum(sizes) :], 0.0)
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(np.asarray(r)).max())


def test_tiles_cover_each_group_once():
  """Every row of every group lies in exactly one tile of that group; no tile reaches past its group."""
  sizes = np.array([5, 0, 17, 3, 10])
  tiles = Tiles.of(jnp.asarray(sizes, jnp.int32), int(sizes.sum()), 4)
  covered = np.full(sizes.sum(), -1)
  for g, first, valid in zip(*(np.asarray(a) for a in (tiles.group, tiles.first, tiles.valid)), strict=True):
    assert (covered[first : first + valid] == -1).all()
    covered[first : first + valid] = g
  np.testing.assert_array_equal(covered, np.repeat(np.arange(len(sizes)), sizes))


@pytest.mark.parametrize(
  "sizes", [[40, 0, 100, 116], [40, 0, 100, 60], [300, 0, 100, 300]], ids=["all_rows", "rows_past_the_groups", "700_rows"]
)
def test_megablox_in_interpret_mode_equals_ragged_dot(sizes):
  """The TPU kernels (Pallas megablox, interpret mode on the CPU): outputs and gradients equal ragged_dot's, also
  when rows lie past the groups (the expert-parallel receive buffers), which the kernels leave undefined, and
  for a row count that is no multiple of the 512-row tile (padded)."""
  rng = np.random.default_rng(1)
  rows = max(256, sum(sizes))
  x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 128, 256)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def weighted(matmul):
    return jax.value_and_grad(lambda x, w: jnp.sum(matmul(x, w) * dy), (0, 1))(x, w)

  got = weighted(lambda x, w: megablox_grouped_matmul(x, w, group_sizes, interpret=True))
  want = weighted(lambda x, w: _ragged_dot(x, w, group_sizes))
  for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(np.asarray(r)).max())


def test_tiles_follow_the_rows_per_group():
  """A power of 2 near an even share of the rows per group, within [8, 256]."""
  assert tile_rows(2048, 8) == 256 and tile_rows(8192, 8) == 256
  assert tile_rows(128, 128) == 8 and tile_rows(96, 4) == 32


def test_megablox_leaving_the_rest_undefined_keeps_it_out_of_what_is_read():
  """zero_rest=False (moe's exact-size exchange): rows past the groups are NaN going in, and so are their
  cotangents coming back (an earlier matmul's undefined rows, and their gradients): the outputs on the rows in
  groups and the gradients of w and of x's rows in groups are ragged_dot's on the clean rows; the NaN reach no sum."""
  rng = np.random.default_rng(2)
  sizes, rows = [20, 0, 50, 30], 128
  used = sum(sizes)
  x = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((4, 128, 128)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((rows, 128)), jnp.float32)
  group_sizes = jnp.asarray(sizes, jnp.int32)
  past = (np.arange(rows) >= used)[:, None]

  y, vjp = jax.vjp(
    lambda x, w: megablox_grouped_matmul(x, w, group_sizes, True, zero_rest=False), jnp.where(past, jnp.nan, x), w
  )
  dx, dw = vjp(jnp.where(past, jnp.nan, dy))
  want_y, want_vjp = jax.vjp(lambda x, w: _ragged_dot(x, w, group_sizes), jnp.where(past, 0, x), w)
  want_dx, want_dw = want_vjp(jnp.where(past, 0, dy))
  for g, r in ((y[:used], want_y[:used]), (dx[:used], want_dx[:used]), (dw, want_dw)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(np.asarray(r)).max())

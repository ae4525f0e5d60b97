"""Grouped matrix multiplication for dropless mixture of experts: rows sorted by group (expert), each group of
rows times its own matrix.

  grouped_matmul(x [rows, k], w [groups, k, n], group_sizes [groups]) -> [rows, n]

Rows sum(group_sizes[:g]) ... sum(group_sizes[:g + 1]) - 1 are multiplied by w[g]; rows past sum(group_sizes) give
zeros. Three implementations, equal to float32 rounding (tests):
  - `megablox_grouped_matmul` (TPU with megablox=true): the Pallas megablox kernels (Gale et al. 2022,
    arXiv:2211.15841) of jax.experimental, tested here in interpret mode;
  - `jax.lax.ragged_dot` (GPU, and TPU with megablox=false), XLA's grouped matmul;
  - `tiled_grouped_matmul` (CPU): XLA's CPU backend lowers ragged_dot to a dense matmul of every row with every
    group's matrix under a mask, num_groups times the FLOPs. Here each group's rows are cut into tiles of
    `tile` rows, every tile is multiplied by its group's matrix in one batched matmul, and the backward pass does
    the same for dx (with the transposed matrices) and dw (tiles' x^T dy, summed per group): the FLOPs of the rows
    actually present, plus at most one partial tile per group.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

MAX_TILE = 256  # Most rows per tile of the CPU implementation (docs/changelog.md, "Mixture of experts").


def tile_rows(rows: int, groups: int) -> int:
  """Rows per tile: a power of 2 near an even group's share of the rows, from 8 to MAX_TILE, so the partial tile
  of each group (up to groups * tile padding rows) stays small next to the rows themselves."""
  share = max(rows // max(groups, 1), 1)
  return min(MAX_TILE, max(8, 1 << (share - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The tiles covering rows sorted by group: tile t holds rows first[t] ... first[t] + valid[t] - 1 of group
  group[t]. Their number is static (rows // tile + groups, an upper bound); unused tiles have valid 0."""

  group: jax.Array  # [tiles] int32
  first: jax.Array  # [tiles] int32
  valid: jax.Array  # [tiles] int32

  @staticmethod
  def of(group_sizes: jax.Array, rows: int, tile: int) -> "Tiles":
    groups = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    per_group = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(per_group)
    t = jnp.arange(rows // tile + groups)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), groups - 1)
    first = ends[group] - group_sizes[group] + (t - (tile_ends[group] - per_group[group])) * tile
    valid = jnp.where(t < tile_ends[-1], jnp.clip(ends[group] - first, 0, tile), 0)
    return Tiles(group.astype(jnp.int32), first.astype(jnp.int32), valid.astype(jnp.int32))

  def gather(self, x: jax.Array, tile: int) -> jax.Array:
    """x [rows, d] -> [tiles, tile, d], zero past each tile's valid rows."""
    rows = self.first[:, None] + jnp.arange(tile)[None]
    taken = jnp.take(x, jnp.minimum(rows, x.shape[0] - 1), axis=0)
    return jnp.where((jnp.arange(tile)[None] < self.valid[:, None])[..., None], taken, 0)

  def scatter(self, y: jax.Array, rows: int) -> jax.Array:
    """[tiles, tile, d] -> [rows, d]: each valid tile row to its row; rows no tile covers are zero."""
    tile = y.shape[1]
    index = jnp.where(jnp.arange(tile)[None] < self.valid[:, None], self.first[:, None] + jnp.arange(tile)[None], rows)
    out = jnp.zeros((rows + 1, y.shape[-1]), y.dtype).at[index.reshape(-1)].set(y.reshape(-1, y.shape[-1]))
    return out[:rows]


def _matmul(a: jax.Array, b: jax.Array, spec: str, dtype) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def tiled_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
  """grouped_matmul by tiles of `tile` rows (see the module docstring); float32 accumulation."""
  return _tiled_fwd(x, w, group_sizes, tile)[0]


def _tiled_fwd(x, w, group_sizes, tile):
  tiles = Tiles.of(group_sizes, x.shape[0], tile)
  y = _matmul(tiles.gather(x, tile), jnp.take(w, tiles.group, axis=0), "tik,tkn->tin", x.dtype)
  return tiles.scatter(y, x.shape[0]), (x, w, group_sizes)


def _tiled_bwd(tile, residuals, dy):
  x, w, group_sizes = residuals
  tiles = Tiles.of(group_sizes, x.shape[0], tile)
  dy_tiles = tiles.gather(dy, tile)
  dx = tiles.scatter(_matmul(dy_tiles, jnp.take(w, tiles.group, axis=0), "tin,tkn->tik", x.dtype), x.shape[0])
  dw_tiles = jnp.einsum("tik,tin->tkn", tiles.gather(x, tile), dy_tiles, preferred_element_type=jnp.float32)
  dw = jnp.zeros(w.shape, jnp.float32).at[tiles.group].add(dw_tiles)  # unused tiles add zeros
  return dx, dw.astype(w.dtype), None


tiled_grouped_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def megablox_grouped_matmul(
  x: jax.Array, w: jax.Array, group_sizes: jax.Array, interpret: bool = False, zero_rest: bool = True
) -> jax.Array:
  """grouped_matmul by Pallas megablox (its own backward kernels). The kernels leave the rows past
  sum(group_sizes) undefined (NaN in interpret mode), forward and backward, so with zero_rest those rows are zeroed
  on the way in and out (where the gradient of a select does not carry what it drops). zero_rest=False leaves them
  undefined, for a caller that never reads them and gives zeros there, as moe's exact-size exchange does: each mask
  is a copy of the rows, 14 GiB per layer at DeepSeek-V3's expert parallelism of 32 (docs/changelog.md)."""
  from jax.experimental.pallas.ops.tpu import megablox

  rows, k = x.shape
  tm = 512 if rows >= 512 else -(-rows // 16) * 16  # gmm needs whole row tiles: pad the rows to a multiple
  padded = -(-rows // tm) * tm
  in_groups = (jnp.arange(padded) < jnp.sum(group_sizes))[:, None]
  x = jnp.pad(x, ((0, padded - rows), (0, 0)))
  tiling = (tm, min(1024, k), min(1024, w.shape[-1]))
  y = megablox.gmm(jnp.where(in_groups, x, 0) if zero_rest else x, w, group_sizes, x.dtype, tiling, interpret=interpret)
  return (jnp.where(in_groups, y, 0) if zero_rest else y)[:rows]


def tiled_grouped_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array, tile: int) -> jax.Array:
  """tiled_grouped_matmul as one batched jax.lax.dot_general over the tiles, differentiated by JAX (the tiles' gather
  and scatter transposed) instead of by hand: the form quantized training takes, since qwix intercepts the
  dot_general and brings its quantized backward pass (the custom VJP would keep the backward's matmuls in float)."""
  tiles = Tiles.of(group_sizes, x.shape[0], tile)
  dims = (((2,), (1,)), ((0,), (0,)))  # tile t: [tile, k] . [k, n]
  y = jax.lax.dot_general(tiles.gather(x, tile), jnp.take(w, tiles.group, axis=0), dims, preferred_element_type=jnp.float32)
  return tiles.scatter(y.astype(x.dtype), x.shape[0])


def grouped_matmul(  # noqa: PLR0913  (the matmul's three operands and the four choices of its form, all by name)
  x: jax.Array,
  w: jax.Array,
  group_sizes: jax.Array,
  platform: str,
  megablox: bool = False,
  quantized: bool = False,
  rest_unread: bool = False,
) -> jax.Array:
  """x [rows, k] x w [groups, k, n] by groups of rows (see the module docstring), for devices of `platform`.
  quantized: qwix's quantized training intercepts this matmul (layers/quantizations.py), so it must be one of the ops
  qwix quantizes: ragged_dot, or on the CPU tiled_grouped_dot; megablox's kernel is none (quantizations refuses it).
  rest_unread: the caller gives zeros in the rows past sum(group_sizes) and never reads them in the output or in
  x's gradient, nor lets any op between two matmuls carry them into a sum (moe's per-expert bias gives them none), so
  megablox may leave them undefined (megablox_grouped_matmul's zero_rest=False)."""
  if platform == "cpu":
    tile = tile_rows(x.shape[0], w.shape[0])
    return (tiled_grouped_dot if quantized else tiled_grouped_matmul)(x, w, group_sizes, tile)
  if platform == "tpu" and megablox:
    return megablox_grouped_matmul(x, w, group_sizes, zero_rest=not rest_unread)
  return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)

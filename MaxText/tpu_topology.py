"""TPU slices by Cloud TPU's names (v5e-256, v5p-128, v4-8, v6e-64) and their devices, without a TPU.

libtpu compiles for any slice it can describe: `jax.experimental.topologies.get_topology_desc` gives a slice's
compile-only devices (platform "tpu") while this process's JAX backend stays the CPU, so a mesh over them and
`jit(...).lower(...).compile()` produce the executable the slice would run (train_compile.py).

Names count as Cloud TPU's accelerator types do, and as MaxText's `compile_topology` does:
  v5e-N, v6e-N  N chips, one TensorCore each: 1, 4, 8, 16, 32, 64, 128 or 256, a 2D torus (16x16 for 256);
  v4-N, v5p-N   N TensorCores, two per chip, which JAX sees as one "megacore" device per chip: 8, 16, 32, 64 (a
                2x2x1 to 2x4x4 slice), then any multiple of 128 up to v4-4096 / v5p-12288 (slices of 4x4x4 cubes,
                shaped as close to a cube as the chip count allows, no side longer than 256 chips).
"""

import dataclasses
import importlib.util
import math
import os

import jax
from jax.experimental import topologies

from MaxText.common_types import ConfigError

# Generation -> (libtpu's name for it, TensorCores per name unit, most TensorCores, Cloud accelerator type prefix).
_GENERATIONS = {
  "v5e": ("v5e", 1, 256, "v5litepod"),
  "v6e": ("v6e", 1, 256, "v6e"),
  "v4": ("v4", 2, 4096, "v4"),
  "v5p": ("v5", 2, 12288, "v5p"),
}
# Slices below one 4x4x4 cube (v4 and v5p), by chips.
_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
_LONGEST_SIDE = 256  # chips; the longer slices of Cloud TPU's list (e.g. v5p-8576 as 4x4x268) are not offered
VALID_FORMS = (
  "v5e-N or v6e-N with N chips in 1, 4, 8, 16, 32, 64, 128, 256; v4-N (up to 4096) or v5p-N (up to 12288) with N "
  "TensorCores in 8, 16, 32, 64 or a multiple of 128"
)


@dataclasses.dataclass(frozen=True)
class Topology:
  """One TPU slice as libtpu describes it."""

  name: str  # as given, e.g. "v5e-256"
  generation: str  # v4, v5e, v5p or v6e
  shape: tuple[int, ...]  # chips along each torus axis, e.g. (16, 16)

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def libtpu_name(self) -> str:
    """get_topology_desc's topology_name, e.g. "v5e:16x16", "v5:4x4x4" (libtpu calls v5p "v5")."""
    return f"{_GENERATIONS[self.generation][0]}:{'x'.join(map(str, self.shape))}"

  @property
  def chip_config(self) -> str:
    """ "megacore": both TensorCores of a v4/v5p chip form one device; "default": one device per core."""
    return "megacore" if _GENERATIONS[self.generation][1] == 2 else "default"

  @property
  def chips_per_host(self) -> tuple[int, int, int]:
    """Chips per host along each axis: 2x2 (four chips a host), a single chip's host for a 1-chip slice."""
    return (1, 1, 1) if self.chips == 1 else (2, 2, 1)


def parse(name: str) -> Topology:
  """A Topology from a name such as "v5e-256"; ConfigError with the valid forms otherwise."""
  generation, _, count = name.partition("-")
  if generation not in _GENERATIONS or not count.isdigit():
    raise ConfigError(f"compile_topology={name!r} is not a TPU topology; use {VALID_FORMS}")
  _, cores_per_chip, most, _ = _GENERATIONS[generation]
  n = int(count)
  shape = None
  if 0 < n <= most and n % cores_per_chip == 0:
    shape = _shape_2d(n) if cores_per_chip == 1 else _shape_3d(n // cores_per_chip)
  if shape is None:
    raise ConfigError(f"compile_topology={name!r}: no {generation} slice has {n} {_unit(generation)}; use {VALID_FORMS}")
  return Topology(name, generation, shape)


def _unit(generation: str) -> str:
  return "chips" if _GENERATIONS[generation][1] == 1 else "TensorCores"


def _shape_2d(chips: int) -> tuple[int, int] | None:
  """v5e/v6e: a square, or two squares side by side, of a power-of-2 chip count (not 2)."""
  log2 = chips.bit_length() - 1
  if chips != 2**log2 or chips == 2:
    return None
  side = 2 ** (log2 // 2)
  return side, chips // side


def _shape_3d(chips: int) -> tuple[int, int, int] | None:
  """v4/v5p: the fixed small slices, else 4x4x4 cubes arranged as a box a x b x c (a <= b <= c cubes) with the
  shortest longest side, then the smallest sum of sides (e.g. 384 chips: 4x8x12, not 4x4x24)."""
  if chips < 64:
    return _SMALL_3D.get(chips)
  if chips % 64:
    return None
  cubes, best = chips // 64, None
  for a in range(1, cubes + 1):
    for b in range(a, cubes // a + 1):
      c, rest = divmod(cubes, a * b)
      if rest == 0 and c >= b and (best is None or (c, a + b + c) < (best[2], sum(best))):
        best = (a, b, c)
  if 4 * best[2] > _LONGEST_SIDE:
    return None
  return tuple(4 * side for side in best)


def devices(topology: Topology, num_slices: int = 1) -> list[jax.Device]:
  """The compile-only devices of `num_slices` copies of the slice (multi-slice devices carry slice_index).

  Needs libtpu (setup.sh TPU_COMPILE=1). The variables set here keep libtpu from looking for a TPU VM's metadata
  server, from warning that it found no accelerator type or worker hostnames, and from refusing to load while
  another process has it (its lock guards a TPU's chips; compiling touches none).
  """
  if importlib.util.find_spec("libtpu") is None:
    raise ConfigError(
      f"compile_topology={topology.name} needs libtpu, which is not installed; run `TPU_COMPILE=1 bash setup.sh` "
      f'(or pip install "jax[tpu]=={jax.__version__}")'
    )
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{_GENERATIONS[topology.generation][3]}-{topology.name.split('-')[1]}")
  return list(
    topologies.get_topology_desc(
      platform="tpu",
      topology_name=topology.libtpu_name,
      chip_config_name=topology.chip_config,
      chips_per_host_bounds=topology.chips_per_host,
      num_slices=num_slices,
    ).devices
  )

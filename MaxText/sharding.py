"""The device mesh and the map from logical axis names to it.

Mesh axes are named by `mesh_axes` and `logical_axis_rules` in the config and nowhere else: layers speak
logical names (common_types) and this module turns them into `NamedSharding`s.
"""

from collections.abc import Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from MaxText import common_types
from MaxText.common_types import Config, ConfigError


def count_slices(devices: Sequence[jax.Device]) -> int:
  """Slices (DCN granules): TPU slices on TPUs, else processes (CPU and GPU devices of a multi-process job
  report slice_index 0 for every process)."""
  if devices[0].platform == "tpu" and hasattr(devices[0], "slice_index"):
    return len({d.slice_index for d in devices})
  return len({d.process_index for d in devices})


def create_mesh(config: Config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """The ICI x DCN device mesh of `config.mesh_shape`, axes named by `config.mesh_axes`."""
  devices = jax.devices() if devices is None else devices
  if len(devices) != config.num_devices:
    raise ConfigError(f"the config was derived for {config.num_devices} devices but {len(devices)} are present")
  if config.num_slices > 1:
    granule_is_process = devices[0].platform != "tpu" or not hasattr(devices[0], "slice_index")
    device_array = mesh_utils.create_hybrid_device_mesh(
      config.ici_mesh_shape,
      config.dcn_mesh_shape,
      devices,
      process_is_granule=granule_is_process,
      allow_split_physical_axes=True,
    )
  else:
    try:
      device_array = mesh_utils.create_device_mesh(config.ici_mesh_shape, devices, allow_split_physical_axes=True)
    except (ValueError, NotImplementedError, AssertionError):
      # Topologies mesh_utils cannot lay out physically (e.g. odd host CPU counts): plain device order.
      device_array = np.asarray(devices).reshape(config.ici_mesh_shape)
  return Mesh(device_array, tuple(config.mesh_axes))


def axis_rules(config: Config) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """`logical_axis_rules` in the form flax.linen's logical partitioning takes."""
  rules = []
  for logical, mesh_axes in config.logical_axis_rules:
    if isinstance(mesh_axes, str):
      rules.append((logical, mesh_axes))
    elif len(mesh_axes) == 0:
      rules.append((logical, None))
    else:
      rules.append((logical, tuple(mesh_axes)))
  return tuple(rules)


def missing_rules(config: Config, names: Sequence[str] = common_types.PARAM_AXES + common_types.ACTIVATION_AXES):
  """Logical names that have no rule (an error: they would silently stay unsharded)."""
  have = {logical for logical, _ in config.logical_axis_rules}
  return [name for name in names if name not in have]


def logical_to_mesh_spec(logical_axes: Sequence[str | None], config: Config) -> PartitionSpec:
  return nn.logical_to_mesh_axes(tuple(logical_axes), axis_rules(config))


def mesh_axes_of(logical: str, config: Config) -> tuple[str, ...]:
  """The mesh axes a logical axis name maps to under the config's rules (none: ())."""
  spec = logical_to_mesh_spec((logical,), config)[0]
  return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def axis_sizes(config: Config, mesh: Mesh | None = None) -> dict[str, int]:
  """Mesh axis name -> size: the mesh's, else the config's mesh_shape."""
  return dict(mesh.shape) if mesh is not None else dict(zip(config.mesh_axes, config.mesh_shape, strict=True))


def logical_sharding(logical_axes: Sequence[str | None], mesh: Mesh, config: Config) -> NamedSharding:
  return NamedSharding(mesh, logical_to_mesh_spec(logical_axes, config))


def tree_shardings(logical_specs, mesh: Mesh, config: Config):
  """A pytree of logical PartitionSpecs (from nn.get_partition_spec) -> a pytree of NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, axis_rules(config))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None, config: Config) -> jax.Array:
  """Constrains an activation's sharding by logical names; a no-op without a mesh (plain apply)."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, mesh, config))


def batch_sharding(mesh: Mesh, config: Config) -> NamedSharding:
  """Sharding of [batch, length] input arrays: batch over the data axes, length over sequence."""
  return logical_sharding((common_types.BATCH, common_types.LENGTH), mesh, config)


def local_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
  """The contiguous range of batch rows that this process's devices hold under `sharding`."""
  starts, stops = [], []
  for index in sharding.addressable_devices_indices_map(global_shape).values():
    rows = index[0]
    starts.append(rows.start or 0)
    stops.append(global_shape[0] if rows.stop is None else rows.stop)
  return slice(min(starts), max(stops))


def make_global_array(local_data: np.ndarray, sharding: NamedSharding, global_shape: tuple[int, ...]) -> jax.Array:
  """One global jax.Array from this process's rows (the same path for one process and for many)."""
  return jax.make_array_from_process_local_data(sharding, local_data, global_shape)

"""Where checkpoints live: `{base_output_directory}/{run_name}/checkpoints/<step>/items`, where <step> is the number
of completed optimizer steps, beside it the data iterator's state (`<step>/data`), the checksums (`<step>/checksums`)
and a quantized params checkpoint's settings (`<step>/quantization`). Orbax writes each one into a temporary folder
and renames it when complete, so a save cut short (even by kill -9) is never listed as a checkpoint (complete_steps,
latest_step); leftovers are removed when the run restarts. A path the config names (load_parameters_path,
load_full_state_path) is a checkpoint's items folder or its step folder, and anything else is refused in one line.
"""

from MaxText import storage
from MaxText.common_types import Config, ConfigError

ITEM = "items"
DATA_ITEM = "data"
CHECKSUM_ITEM = "checksums"  # integrity.record of the items, as JSON (Orbax's JsonSave writes it to a file "metadata")
QUANTIZATION_ITEM = "quantization"  # a quantized params checkpoint's quantizations.settings, as JSON (likewise)


def run_dir(config: Config) -> str:
  """{base_output_directory}/{run_name}: what a run writes (checkpoints, tensorboard, config.yml)."""
  if not config.run_name:
    raise ConfigError("run_name is empty; pass run_name=NAME (output goes to base_output_directory/NAME)")
  return storage.join(config.base_output_directory, config.run_name)  # Absolute or a URL: pyconfig.parse saw to it.


def checkpoint_dir(config: Config) -> str:
  return storage.join(run_dir(config), "checkpoints")


def items_path(key: str, path: str) -> str:
  """Accepts a checkpoint's `items` folder or its step folder; rejects anything else in one line."""
  path = storage.expand(path)
  if storage.isdir(storage.join(path, ITEM)):
    path = storage.join(path, ITEM)
  if not storage.isdir(path):
    raise ConfigError(f"{key}={path} does not exist; give a checkpoint's items folder, e.g. RUN/checkpoints/100/items")
  if ".orbax-checkpoint-tmp" in path:
    raise ConfigError(f"{key}={path} is an unfinished checkpoint (its save was interrupted); pick a complete one")
  if not any(storage.exists(storage.join(path, name)) for name in ("_METADATA", "manifest.ocdbt", "_sharding")):
    raise ConfigError(
      f"{key}={path} holds no Orbax checkpoint (no _METADATA or manifest.ocdbt); give a checkpoint's items folder, "
      "e.g. RUN/checkpoints/100/items"
    )
  return path


def complete_steps(config: Config) -> list[int]:
  """The steps of the run's complete checkpoints, oldest first (a save in progress or cut short is still in
  Orbax's temporary folder, whose name is not a number)."""
  directory = checkpoint_dir(config)
  return sorted(int(n) for n in storage.listdir(directory) if n.isdigit() and storage.isdir(storage.join(directory, n)))


def latest_step(config: Config) -> int | None:
  """The run's latest complete checkpoint step, read from the folder names (unfinished saves are skipped)."""
  where = checkpoint_dir(config)
  steps = [int(n) for n in storage.listdir(where) if n.isdigit()]
  return max(steps, default=None)


def params_path(config: Config) -> str:
  """Where restore_params reads: load_parameters_path (or load_full_state_path), else the run's latest checkpoint."""
  key = "load_parameters_path" if config.load_parameters_path else "load_full_state_path"
  given = config.load_parameters_path or config.load_full_state_path
  if given:
    return items_path(key, given)
  if not config.run_name:
    raise ConfigError(
      "no parameters to load: give load_parameters_path=PATH/checkpoints/STEP/items (or the run_name of a run)"
    )
  step = latest_step(config)
  if step is None:
    raise ConfigError(
      f"no parameters to load: load_parameters_path is empty and run_name={config.run_name} has no checkpoint "
      f"in {checkpoint_dir(config)}; give load_parameters_path=PATH/checkpoints/STEP/items"
    )
  return storage.join(checkpoint_dir(config), str(step), ITEM)


def check_new_params_dir(key: str, directory: str) -> None:
  """ConfigError when `directory` (where save_params would write) already holds a checkpoint: none is overwritten."""
  if storage.isdir(directory) and any(name.isdigit() for name in storage.listdir(directory)):
    raise ConfigError(f"{key}={directory} already holds a checkpoint; give a new folder (none is ever overwritten)")

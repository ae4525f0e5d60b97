"""What makes a checkpoint damaged, and how that is found. Every checkpoint records a checksum of each array, and its
data state carries its own (integrity.py); restoring verifies them. A checkpoint without checksums is damaged too
when it was saved with them (its Orbax metadata names them, or its folder for them is there) or when an earlier
checkpoint of its folder has them; only a checkpoint of a run older than checksums (none before it has any) is
restored unverified, and the log says so. Likewise a data state without its seal in a checkpoint with checksums (the
two came together) is damaged. So is a checkpoint whose metadata or arrays cannot be read (the array whose file is
truncated is named; Orbax's echoes of its abandoned reads are dropped, drop_abandoned_io). Every such checkpoint is
`Damaged`, a ConfigError: on resume restore.py skips it for the newest one that verifies and sets it aside as
<step>.damaged (_set_aside), with the reason in the log; a damaged load_parameters_path or load_full_state_path is
an error.
"""

import gc
import json
import re
import sys
import traceback

import jax

from MaxText import integrity, storage
from MaxText.checkpointing.disk import out_of_space
from MaxText.checkpointing.paths import CHECKSUM_ITEM, DATA_ITEM, ITEM
from MaxText.common_types import ConfigError

# TensorStore's read error: `OUT_OF_RANGE: Error reading "params.x.kernel/0.1" in OCDBT database at local file
# "RUN/checkpoints/5/items/": Requested byte range [38372, 40308) is not valid for value of size 27705`.
_STORE_READ = re.compile(
  r'(?:(?P<code>[A-Z_]+): )?Error reading "(?P<key>[^"]+)" in \w+ database at (?P<store>.+?): (?P<why>.*)'
)


class Damaged(ConfigError):
  """A checkpoint that cannot be read, or whose arrays or data state differ from what was recorded at its save."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"checkpoint {where} is damaged: {reason}")
    self.where, self.reason = where, reason


def _error_text(error: BaseException) -> str:
  # Orbax's read error formats TensorStore's spec method instead of calling it ("<bound method ...spec of ...>").
  text = re.sub(r"\s*See full TensorStore details: <bound method .*", "", " ".join(str(error).split()))
  return f"{type(error).__name__}: {text[:200]}"


def _root_cause(error: BaseException) -> BaseException:
  """The innermost error `error` was raised from (TensorStore's, under Orbax's wrapper)."""
  seen = {id(error)}
  while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
    seen.add(id(inner))
    error = inner
  return error


def _metadata(path: str):
  import orbax.checkpoint as ocp

  try:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(path).item_metadata.tree
  except Exception as e:  # noqa: BLE001 (any failure to read means unreadable)
    where = storage.dirname(path) if path.rstrip("/").endswith("/" + ITEM) else path
    raise Damaged(where, f"its metadata cannot be read ({_error_text(e)})") from None


def _recorded_checksums(items: str) -> dict | None:
  """The integrity.record saved beside the checkpoint's `items` folder; None for a checkpoint saved without one
  (one older than checksums). Damaged when it lacks them although it was saved with them (see _saved_with_checksums)."""
  step_dir = storage.dirname(items)
  path = storage.join(step_dir, CHECKSUM_ITEM, "metadata")
  if not storage.exists(path):
    evidence = _saved_with_checksums(step_dir)
    if evidence:
      raise Damaged(step_dir, f"its checksums ({CHECKSUM_ITEM}/metadata) are missing, though {evidence}")
    return None
  try:
    return json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise Damaged(storage.dirname(items), f"its checksums cannot be read ({_error_text(e)})") from None


def _saved_with_checksums(step_dir: str) -> str | None:
  """Why checkpoint `step_dir` must have checksums, or None: its own Orbax metadata names a checksums item, or its
  checksums folder exists, or an earlier checkpoint of the same folder has checksums (saved by a version that
  records them, as every later one is). A run older than checksums has none anywhere; a run that was upgraded has
  them only from some step on, so only earlier steps count."""
  if storage.isdir(storage.join(step_dir, CHECKSUM_ITEM)):
    return f"its {CHECKSUM_ITEM} folder exists"
  try:
    handlers = json.loads(storage.read_text(storage.join(step_dir, "_CHECKPOINT_METADATA"))).get("item_handlers") or {}
  except (OSError, ValueError, AttributeError):
    handlers = {}  # None written (an imported model) or unreadable: the other evidence decides.
  if CHECKSUM_ITEM in handlers:
    return "its _CHECKPOINT_METADATA says it was saved with them"
  step = _step_of(step_dir.rstrip("/").rsplit("/", 1)[-1])
  if step is None:
    return None
  parent = storage.dirname(step_dir)
  earlier = sorted((s, n) for n in storage.listdir(parent) if (s := _step_of(n)) is not None and s < step)
  for _, other in reversed(earlier):  # the nearest first: on a bucket each look is a request
    if storage.exists(storage.join(parent, other, CHECKSUM_ITEM, "metadata")):
      return f"the earlier checkpoint {storage.join(parent, other)} has them"
  return None


def _step_of(name: str) -> int | None:
  """The step of a checkpoint folder's name: <step>, or <step>.damaged once set aside."""
  head = name.split(".", 1)[0]
  return int(head) if head.isdigit() else None


def verify(items: str, tree) -> str:
  """Checks the restored `tree` against the checksums recorded when the checkpoint at `items` was saved; raises
  Damaged on a difference. Returns what was verified, for the log."""
  recorded = _recorded_checksums(items)
  if recorded is None:
    return "saved without checksums, not verified"
  try:
    return f"{integrity.verify(recorded, tree)} arrays verified"
  except integrity.Mismatch as e:
    raise Damaged(storage.dirname(items), str(e)) from None


def _read_arrays(where: str, restore):
  """(restore(), None), or (None, Damaged) when Orbax cannot read the arrays of checkpoint `where` (its metadata
  matched the config, so a failure to read is damage)."""
  drop_abandoned_io()  # (before: some are printed while Orbax is still failing)
  try:
    return restore(), None
  except Exception as e:  # noqa: BLE001 (its metadata matched the config: a failure to read is damage)
    damage = _unreadable(where, e)
  gc.collect()  # Orbax's abandoned reads are closed now that the error is let go, not at some later moment.
  return None, damage


def drop_abandoned_io() -> None:
  """When one array read or write fails, Orbax leaves the others: each pending read raises again as it is closed
  (it catches BaseException), and each TensorStore callback of a finished one finds its event loop closed. Python
  prints every one as `Exception ignored in: ...`, hundreds of lines with TensorStore specs for one damaged file,
  from Orbax's and TensorStore's threads at any later moment; and a full disk's error comes again from writers
  that flush at exit (TensorBoard's). So from the first restore (or the start of a command) on, a
  sys.unraisablehook drops those echoes (the failure itself is reported in one line) and hands anything else to
  the hook it replaced."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_abandoned_io", False):
    return

  def abandoned(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
      return "orbax" in code.co_filename
    if out_of_space(unraisable.exc_value):
      return True
    frames = traceback.extract_tb(unraisable.exc_traceback)
    closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    return unraisable.object is None and closed and bool(frames) and frames[0].name == "call_soon_threadsafe"

  def hook(unraisable):
    if not abandoned(unraisable):
      previous(unraisable)

  hook.drops_abandoned_io = True
  sys.unraisablehook = hook


def _unreadable(where: str, error: Exception) -> "Damaged":
  """Damaged, naming the array whose stored bytes could not be read and where they are stored, when TensorStore
  says (a data file cut short or overwritten)."""
  root = _root_cause(error)
  read = _STORE_READ.search(" ".join(str(root).split()))
  if read is None:
    return Damaged(where, f"its arrays cannot be read ({_error_text(root)})")
  name, why = read["key"].rsplit("/", 1)[0], f"{read['code']}: {read['why']}" if read["code"] else read["why"]
  return Damaged(
    where, f"its array {name} cannot be read from {read['store']}: a data file is truncated or damaged ({why[:160]})"
  )


def _set_aside(where: str) -> str:
  """Renames a damaged checkpoint folder to <step>.damaged (not a step number, so no longer a checkpoint);
  process 0 does it, the others wait."""
  target = f"{where}.damaged"
  if jax.process_index() == 0:
    suffix = 1
    while storage.exists(target):
      suffix += 1
      target = f"{where}.damaged{suffix}"
    storage.rename(where, target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("damaged checkpoint set aside")
  return target


def _verify_data_file(where: str) -> None:
  """Checks this process's data state in checkpoint `where` against its checksum (before restoring anything)."""
  path = storage.join(where, DATA_ITEM, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
  if storage.exists(path):  # A missing one is restore_data's error: another process count, or synthetic data.
    sealed_when_saved = storage.exists(storage.join(where, CHECKSUM_ITEM, "metadata"))  # (the two came together)
    try:
      integrity.open_data(storage.read_bytes(path), sealed_when_saved)
    except (OSError, integrity.Mismatch) as e:
      raise Damaged(where, str(e)) from None

"""Checkpoint conversion between Hugging Face and MaxText (convert_hf_checkpoint.py, convert_to_hf_checkpoint.py),
and the small pieces both scripts share."""

import contextlib
import os
import shutil


def get(tree: dict, dotted: str):
  for key in dotted.split("."):
    tree = tree[key]
  return tree


def put(tree: dict, dotted: str, value) -> None:
  *parents, last = dotted.split(".")
  for key in parents:
    tree = tree.setdefault(key, {})
  tree[last] = value


@contextlib.contextmanager
def staged(target: str):
  """Yields a fresh sibling folder to write into; it becomes `target` (which must not exist, or be an empty
  folder) only if the block completes, and is removed otherwise, with the parent folders made for it (those
  still empty), so a refused or failed run leaves nothing behind."""
  staging = f"{target.rstrip('/')}.partial-{os.getpid()}"
  made = []  # the missing ancestors os.makedirs creates, deepest first
  parent = os.path.dirname(os.path.abspath(staging))
  while not os.path.exists(parent):
    made.append(parent)
    parent = os.path.dirname(parent)
  os.makedirs(staging)
  done = False
  try:
    yield staging
    if os.path.isdir(target):
      os.rmdir(target)
    os.rename(staging, target)
    done = True
  finally:
    shutil.rmtree(staging, ignore_errors=True)
    for folder in made if not done else ():
      try:
        os.rmdir(folder)  # Only while empty: never what something else wrote there meanwhile.
      except OSError:
        break


def new_file_mode() -> int:
  """The mode open() gives a new file: 0o666 less the process's umask. For files a library creates private
  (safetensors' save_file writes 0o600), so they are readable like the files beside them."""
  try:
    with open("/proc/self/status") as f:  # Linux: read without changing it (os.umask sets it, for every thread).
      mask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
  except (OSError, StopIteration, ValueError, IndexError):
    mask = os.umask(0o022)
    os.umask(mask)
  return 0o666 & ~mask

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
  folder) only if the block completes, and is removed otherwise, so no half-written output is ever left."""
  staging = f"{target.rstrip('/')}.partial-{os.getpid()}"
  os.makedirs(staging)
  try:
    yield staging
    if os.path.isdir(target):
      os.rmdir(target)
    os.rename(staging, target)
  finally:
    shutil.rmtree(staging, ignore_errors=True)

"""Checkpoint conversion between Hugging Face and MaxText (convert_hf_checkpoint.py, convert_to_hf_checkpoint.py),
and the small pieces both scripts share."""

import contextlib
import os
import shutil

# The files a Hugging Face tokenizer keeps beside its tokenizer.json (or tokenizer.model), copied with it by the import
# and the export: what transformers' AutoTokenizer and GenerationConfig read besides it (special tokens, the chat
# template, where generation stops), so that a folder's tokenizer is the whole tokenizer, and input_pipeline/sft.py
# finds the model's own chat template beside it.
TOKENIZER_COMPANIONS = (
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "chat_template.jinja",
  "chat_template.json",
  "generation_config.json",
)


def tokenizer_companions(folder: str) -> list[str]:
  """The TOKENIZER_COMPANIONS that are files in `folder`."""
  return [name for name in TOKENIZER_COMPANIONS if os.path.isfile(os.path.join(folder, name))]


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

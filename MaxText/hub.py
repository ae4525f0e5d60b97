"""hf_model_path as a Hugging Face Hub model id (`owner/name`): the local folder the importer reads.

A value that is a local folder, or that looks like a path, is returned as it is (the importer's own errors apply to
it). Otherwise an id is resolved with `huggingface_hub.snapshot_download` into Hugging Face's usual cache
(HF_HUB_CACHE, by default ~/.cache/huggingface/hub), fetching only what the importer reads (FILES). Offline
(HF_HUB_OFFLINE=1, no connection, a repository that needs a token) a complete cached snapshot is used; with none, a
ConfigError says so in one line. huggingface_hub reads its environment variables (HF_HUB_OFFLINE, HF_HUB_CACHE,
HF_ENDPOINT) when it is imported, so they are set before a run starts; it is imported here only for an id.
"""

import os
import re

from MaxText.common_types import ConfigError, cut
from MaxText.convert import TOKENIZER_COMPANIONS

# What convert_hf_checkpoint.py reads from a Hugging Face folder (read_hf_config, HFTensors, find_tokenizer): the
# config, the weights, the tokenizer and what is copied beside it (the chat template, generation_config.json's EOS
# ids). Nothing else: no pickled weights, no ONNX or GGUF copies, no original/ consolidated checkpoints.
FILES = (
  "config.json",
  "*.safetensors",
  "model.safetensors.index.json",
  "tokenizer.json",
  "tokenizer.model",
  "original/tokenizer.model",
  *TOKENIZER_COMPANIONS,
)

# Hub ids: huggingface_hub's validate_repo_id (utils/_validators.py), with the owner required: each part of
# letters, digits, "-", "_" and ".", not starting or ending with "-" or ".", at most 96 characters; no "--" or "..",
# no ".git" at the end.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_ID = re.compile(rf"{_PART}/{_PART}")


def is_hub_id(value: str) -> bool:
  """True for `owner/name` as the Hub spells a model id (and not a path: no "./", "~", a leading or trailing "/")."""
  return (
    bool(_ID.fullmatch(value))
    and all(len(part) <= 96 for part in value.split("/"))
    and "--" not in value
    and ".." not in value
    and not value.endswith(".git")
  )


def model_folder(value: str, key: str = "hf_model_path") -> str:
  """The local folder of `value`: `value` itself (with ~ expanded) unless it is a Hub id that is no local folder,
  which is fetched into (or found in) the Hugging Face cache; ConfigError naming `key` when neither is possible."""
  local = os.path.expanduser(value)
  if os.path.exists(local) or not is_hub_id(value):
    return local
  import huggingface_hub
  from huggingface_hub import constants, errors

  cache = constants.HF_HUB_CACHE
  unreachable = "HF_HUB_OFFLINE=1" if constants.is_offline_mode() else _unreachable(value)
  before = _cached_files(cache, value)
  try:  # Offline: a complete cached snapshot (of refs/main), as snapshot_download finds one.
    folder = huggingface_hub.snapshot_download(value, allow_patterns=list(FILES), local_files_only=bool(unreachable))
  except (errors.HfHubHTTPError, OSError) as e:  # LocalEntryNotFoundError is an OSError too
    if not unreachable:  # online: a download broke off, or the cache cannot be written
      reason = f"the download from {constants.ENDPOINT} failed ({_cause(e)})"
    elif isinstance(e, errors.IncompleteSnapshotError):
      reason = f"its cached snapshot is incomplete and {unreachable}"
    elif isinstance(e, errors.LocalEntryNotFoundError):
      reason = f"it is not in the cache and {unreachable}"
    else:
      reason = f"its cached snapshot cannot be read ({_cause(e)})"
    raise _refusal(key, value, cache, reason) from None
  fetched = len(_cached_files(cache, value) - before)
  how = (
    f"from the cache ({unreachable})"
    if unreachable
    else f"{fetched} files fetched"
    if fetched
    else "up to date in the cache"
  )
  print(f"{key}={value}: Hugging Face Hub snapshot {os.path.basename(folder)}, {how}, in {folder}", flush=True)
  return folder


def _unreachable(repo_id: str) -> str:
  """Why the Hub cannot give `repo_id` ("" when it can), asked once with a bounded wait: snapshot_download's own
  look-up has none (huggingface_hub's client has no timeout), so a Hub that accepts the connection and never
  answers would hang the import. The wait is HF_HUB_ETAG_TIMEOUT (huggingface_hub's, 10 s by default)."""
  import httpx2  # huggingface_hub's HTTP client
  from huggingface_hub import HfApi, constants, errors

  try:
    HfApi().repo_info(repo_id, timeout=constants.HF_HUB_ETAG_TIMEOUT)
  except errors.GatedRepoError:
    return "the repository is gated (accept its terms on the Hub and give a token: HF_TOKEN or hf auth login)"
  except errors.RepositoryNotFoundError:
    return "the Hub has no such repository, or it is private (give a token: HF_TOKEN or hf auth login)"
  except httpx2.HTTPError as e:  # no connection, a timeout, an HTTP error (HfHubHTTPError is one)
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None and e.response.status_code in (401, 403, 404):
      return f"the Hub at {constants.ENDPOINT} has no such repository or needs a token (HF_TOKEN): {_cause(e)}"
    return f"the Hugging Face Hub cannot be reached at {constants.ENDPOINT} ({_cause(e)})"
  return ""


def _cached_files(cache: str, repo_id: str) -> set[str]:
  """The files of every cached snapshot of `repo_id` (huggingface_hub's cache layout: models--owner--name)."""
  snapshots = os.path.join(cache, "models--" + repo_id.replace("/", "--"), "snapshots")
  return {os.path.join(d, f) for d, _, files in os.walk(snapshots) for f in files}


def _cause(error: BaseException) -> str:
  """The first line of the deepest cause (a connection refused, a timeout), cut to stay one readable line."""
  while error.__cause__ is not None:
    error = error.__cause__
  text = str(error).strip().splitlines()
  return cut(f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": "))


def _refusal(key: str, value: str, cache: str, reason: str) -> ConfigError:
  return ConfigError(
    f"{key}={cut(value)} is not a local folder and is a Hugging Face Hub id that cannot be used: {reason}; download it "
    f"where the Hub is reachable (hf download {cut(value)}) into this cache (HF_HUB_CACHE={cache}), or give a local "
    "folder"
  )

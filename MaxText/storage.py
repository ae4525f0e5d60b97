"""User paths, local or remote: the one place that touches them, so every output and input path of a run works
on a bucket (gs://..., or any URL etils.epath handles) as on a local disk.

Local paths go straight to os and open(). URLs go through etils.epath, which reaches Google Cloud Storage through
gcsfs (gcsfs and google-cloud-storage honour STORAGE_EMULATOR_HOST, so tests run against a local emulator).
Checkpoint arrays never pass here: Orbax writes them through TensorStore, which reads TENSORSTORE_GCS_HTTP_URL.
A bucket has no folders: a "folder" exists once something is written under it, and making one is a no-op.
"""

import io
import os
import posixpath
import time


def is_remote(path: str) -> bool:
  return "://" in path


def _epath(path: str):
  if os.environ.get("EPATH_USE_TF") is None:
    os.environ["EPATH_USE_TF"] = "false"  # gcsfs, even where TensorFlow is importable (its gfile needs no more).
  from etils import epath

  return epath.Path(path)


def expand(path: str) -> str:
  """A local path with ~ expanded; a URL as it is."""
  return path if is_remote(path) else os.path.expanduser(path)


def join(path: str, *parts: str) -> str:
  return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
  return posixpath.dirname(path.rstrip("/")) if is_remote(path) else os.path.dirname(path)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
  return _epath(path).is_dir() if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
  return _epath(path).is_file() if is_remote(path) else os.path.isfile(path)


def listdir(path: str) -> list[str]:
  """Names in folder `path`; [] when there is none."""
  if is_remote(path):
    folder = _epath(path)
    return [p.name for p in folder.iterdir()] if folder.is_dir() else []
  return os.listdir(path) if os.path.isdir(path) else []


def makedirs(path: str) -> None:
  if is_remote(path):
    _epath(path).mkdir(parents=True, exist_ok=True)
  else:
    os.makedirs(path, exist_ok=True)


def rename(path: str, target: str) -> None:
  """Moves a file or folder (on a bucket: copies its objects and deletes them)."""
  if is_remote(path):
    import fsspec  # gcsfs's interface, as etils.epath uses it; moves a "folder" object by object

    fs, source = fsspec.core.url_to_fs(path)
    fs.mv(source, fsspec.core.url_to_fs(target)[1], recursive=True)
  else:
    os.rename(path, target)


def remove(path: str) -> None:
  if is_remote(path):
    _epath(path).unlink()
  else:
    os.remove(path)


def read_bytes(path: str) -> bytes:
  if is_remote(path):
    return _epath(path).read_bytes()
  with open(path, "rb") as f:
    return f.read()


def read_text(path: str) -> str:
  return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file, all or nothing: an object on a bucket; locally a temporary file renamed into place."""
  if is_remote(path):
    _epath(path).write_bytes(data)
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  partial = f"{path}.partial"
  with open(partial, "wb") as f:
    f.write(data)
  os.replace(partial, path)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode("utf-8"))


class AppendedText:
  """A text file lines are appended to (the metrics file). Locally an open file flushed at each write; on a
  bucket, whose objects cannot be appended to, the whole text is uploaded again on `flush` at most every
  `upload_every` seconds, and on `close` (a run killed in between loses the last lines, as a local run loses
  what it had not flushed)."""

  def __init__(self, path: str, upload_every: float = 10.0):
    self.path, self.upload_every = path, upload_every
    self.remote = is_remote(path)
    if self.remote:
      self.buffer = io.StringIO()
      earlier = read_text(path) if exists(path) else ""
      self.buffer.write(earlier if not earlier or earlier.endswith("\n") else earlier + "\n")
      self.last_upload = 0.0
      return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.file = open(path, "a+", encoding="utf-8")  # noqa: SIM115 (closed by close())
    if self.file.tell() > 0:
      self.file.seek(self.file.tell() - 1)
      if self.file.read(1) != "\n":
        self.file.write("\n")  # A line cut short (a killed run) is ended, so the next record is a line of its own.

  def write_line(self, line: str) -> None:
    if self.remote:
      self.buffer.write(line + "\n")
      if time.time() - self.last_upload >= self.upload_every:
        self._upload()
    else:
      self.file.write(line + "\n")
      self.file.flush()

  def _upload(self) -> None:
    write_text(self.path, self.buffer.getvalue())
    self.last_upload = time.time()

  def close(self) -> None:
    if self.remote:
      self._upload()
    else:
      self.file.close()

"""User paths, local or remote: the one place that touches them, so every output and input path of a run works
on a bucket (gs://..., or any URL etils.epath handles) as on a local disk.

Local paths go straight to os and open(). URLs go through etils.epath, which reaches Google Cloud Storage through
gcsfs (gcsfs and google-cloud-storage honour STORAGE_EMULATOR_HOST, so tests run against a local emulator).
Checkpoint arrays never pass here: Orbax writes them through TensorStore, which reads TENSORSTORE_GCS_HTTP_URL.
A bucket has no folders: a "folder" exists once something is written under it, and making one is a no-op.
check_access asks a gs:// bucket, before a run writes anything, whether it is reachable, exists and accepts the
credentials, so a run that could not use it stops in seconds with one line instead of after a minute of retries.
"""

import io
import json
import os
import posixpath
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from MaxText.common_types import ConfigError, cut


def is_remote(path: str) -> bool:
  return "://" in path


def _epath(path: str):
  if os.environ.get("EPATH_USE_TF") is None:
    os.environ["EPATH_USE_TF"] = "false"  # gcsfs, even where TensorFlow is importable (its gfile needs no more).
  import fsspec.config

  # gcsfs keeps a folder's listing for the life of the process by default; other processes and hosts write to
  # the bucket meanwhile (checkpoints of a job, a run resumed beside a reader), so every listing asks the bucket.
  fsspec.config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)
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


# What a path that is not a regular file is, in words for an error message.
_FILE_KINDS = (
  (stat.S_ISDIR, "a folder"),
  (stat.S_ISFIFO, "a FIFO"),
  (stat.S_ISCHR, "a character device"),
  (stat.S_ISBLK, "a block device"),
  (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
  """What an os.stat st_mode is, in words ("a file", "a folder", "a FIFO", ...)."""
  if stat.S_ISREG(mode):
    return "a file"
  return next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), "a special file")


def check_file(key: str, path: str, hint: str) -> None:
  """Raises ConfigError (`key`=`path`: what it is; `hint`) unless the local `path` is a regular file this user can
  read. A folder, FIFO or device is refused without being opened: reading /dev/zero or a FIFO never ends."""
  try:
    mode = os.stat(path).st_mode
  except (FileNotFoundError, NotADirectoryError):
    raise ConfigError(f"{key}={cut(path)} does not exist; {hint}") from None
  except (OSError, ValueError) as e:  # a link loop, a folder this user cannot search; ValueError: a NUL in the path
    raise ConfigError(f"{key}={cut(repr(path))} cannot be read ({getattr(e, 'strerror', None) or e}); {hint}") from None
  if not stat.S_ISREG(mode):
    raise ConfigError(f"{key}={cut(path)} is not a regular file (it is {file_kind(mode)}); {hint}")
  if not os.access(path, os.R_OK):
    raise ConfigError(f"{key}={cut(path)} is not readable by this user; {hint}")


GCS_ENDPOINT = "https://storage.googleapis.com"
ACCESS_TIMEOUT = 4.0  # seconds per request of check_access
ACCESS_DEADLINE = 10.0  # seconds for all of check_access (finding and refreshing credentials included)
_FINDING_CREDENTIALS = "looking for Google Cloud credentials"
_LOGIN = "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service account key file"


def check_access(key: str, url: str, write: bool) -> None:
  """Before a run writes anything: ConfigError, one line naming `key`, the bucket, what failed and the fix, unless
  the bucket of the gs:// `url` answers within seconds, with credentials it accepts, exists, and (write) lets them
  create objects. Nothing is written: the checks are a listing of at most one object name and, for write, an IAM
  permission test. A local path, or a URL of another scheme, is left as it is.

  The endpoint is where gcsfs and google-cloud-storage go: STORAGE_EMULATOR_HOST (an emulator, used without
  credentials), else Google Cloud Storage with the application default credentials (google.auth.default)."""
  if not url.startswith("gs://"):
    return
  shown = _cut(url)
  bucket, _, prefix = url[len("gs://") :].partition("/")
  if not bucket:
    raise ConfigError(f"{key}={shown} names no bucket; give gs://BUCKET/PATH")
  stage = [_FINDING_CREDENTIALS]  # what the check is doing, for a deadline's message
  outcome: list[BaseException] = []

  def work():
    try:
      _check_bucket(bucket, prefix, write, stage)
    except BaseException as e:  # noqa: BLE001 (handed to the calling thread)
      outcome.append(e)

  worker = threading.Thread(target=work, name="check_access", daemon=True)  # a hung lookup cannot hold the run
  worker.start()
  worker.join(ACCESS_DEADLINE)
  if worker.is_alive():
    if not write and stage[0] == _FINDING_CREDENTIALS:
      return  # Off Google Cloud, google.auth may wait for a metadata server: reading a public bucket needs none.
    raise ConfigError(
      f"{key}={shown}: bucket {bucket} is unreachable: no answer within {ACCESS_DEADLINE:g} s while {stage[0]}; "
      "check the network (or STORAGE_EMULATOR_HOST), or use a local path"
    )
  if outcome and isinstance(outcome[0], _AccessDenied):
    raise ConfigError(f"{key}={shown}: {outcome[0]}") from None
  if outcome:  # e.g. a malformed credentials file
    error = outcome[0]
    raise ConfigError(
      f"{key}={shown}: bucket {bucket} cannot be checked ({type(error).__name__}: {_cut(error)}); {_LOGIN}"
    ) from None


class _AccessDenied(Exception):
  """What check_access found wrong with a bucket, and the fix: the text after `key=url: `."""


def _check_bucket(bucket: str, prefix: str, write: bool, stage: list[str]) -> None:
  emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
  endpoint = (emulator if "://" in emulator else f"http://{emulator}") if emulator else GCS_ENDPOINT
  headers, missing = {}, None  # missing: why there are no credentials, when there are none
  if not emulator:
    token, missing = _access_token(bucket, stage)
    if token:
      headers["Authorization"] = f"Bearer {token}"
  if missing and write:  # No bucket takes anonymous writes: nothing to ask the endpoint.
    raise _AccessDenied(f"no Google Cloud credentials to write to bucket {bucket} ({missing}); {_LOGIN}")
  stage[0] = f"reaching {endpoint}"
  api = f"{endpoint.rstrip('/')}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}"
  status, body = _get(f"{api}/o?{urllib.parse.urlencode({'maxResults': 1, 'prefix': prefix, 'fields': 'kind'})}", headers)
  if status is None:
    raise _AccessDenied(
      f"bucket {bucket} is unreachable: {endpoint} does not answer ({body}); check the network (or "
      "STORAGE_EMULATOR_HOST), or use a local path"
    )
  if status == 404:
    raise _AccessDenied(
      f"bucket {bucket} does not exist at {endpoint}; fix the name, or create it (gcloud storage buckets create "
      f"gs://{bucket})"
    )
  if missing and status in (401, 403):
    raise _AccessDenied(f"no Google Cloud credentials to read bucket {bucket} ({missing}); {_LOGIN}")
  if status == 401:
    raise _AccessDenied(f"bucket {bucket} refused the credentials (HTTP 401: {body}); {_LOGIN}")
  if status == 403:
    raise _AccessDenied(
      f"these credentials may not read bucket {bucket} (HTTP 403: {body}); grant them roles/storage.objectViewer "
      "on it (objectAdmin to write), or use another bucket"
    )
  if status != 200 or not write:  # (A server error is left to the storage library, which retries.)
    return
  status, body = _get(f"{api}/iam/testPermissions?permissions=storage.objects.create", headers)
  try:
    answer = json.loads(body) if status == 200 else {}
  except ValueError:
    answer = {}
  granted = answer.get("permissions", []) if isinstance(answer, dict) else []
  if isinstance(answer, dict) and answer.get("kind") == "storage#testIamPermissionsResponse":
    if "storage.objects.create" not in granted:  # (Any other answer: not known cheaply; the first write tells.)
      raise _AccessDenied(
        f"these credentials may not write to bucket {bucket} (they lack storage.objects.create); grant them "
        "roles/storage.objectAdmin on it, or use another path"
      )


def _access_token(bucket: str, stage: list[str]) -> tuple[str | None, str | None]:
  """(an access token of the application default credentials, None), or (None, why there are none: gcsfs then
  goes on anonymously, which a public bucket allows for reading); _AccessDenied when they are refused."""
  import google.auth
  import google.auth.exceptions
  import google.auth.transport.requests

  try:
    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
  except google.auth.exceptions.DefaultCredentialsError as e:
    return None, _cut(e)
  stage[0] = "refreshing the Google Cloud credentials"
  session = google.auth.transport.requests.Request()

  def request(*args, timeout=None, **kwargs):  # google.auth's own default is 120 s
    return session(*args, timeout=ACCESS_TIMEOUT, **kwargs)

  try:
    credentials.refresh(request)
  except google.auth.exceptions.RefreshError as e:
    raise _AccessDenied(f"the Google Cloud credentials for bucket {bucket} were refused ({_cut(e)}); {_LOGIN}") from None
  except google.auth.exceptions.TransportError as e:
    raise _AccessDenied(
      f"bucket {bucket} is unreachable: the Google Cloud credentials could not be refreshed ({_cut(e)}); check the "
      "network, or use a local path"
    ) from None
  return credentials.token, None


def _get(url: str, headers: dict) -> tuple[int | None, str]:
  """(HTTP status, body cut short) of a GET with a short timeout; (None, why) when nothing answers."""
  try:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=ACCESS_TIMEOUT) as response:
      return response.status, response.read(4096).decode("utf-8", "replace")
  except urllib.error.HTTPError as e:
    return e.code, _cut(e.read(4096).decode("utf-8", "replace"))
  except OSError as e:  # URLError, a refused connection, a timeout
    return None, _cut(getattr(e, "reason", e))


def _cut(text) -> str:
  """`text` on one line, cut to 120 characters."""
  return cut(" ".join(str(text).split()), 120)

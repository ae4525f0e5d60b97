"""A Google Cloud Storage bucket on loopback for tests: PyPI's gcp-storage-emulator (2026.7.19), patched for what
gcsfs and TensorStore (so Orbax) need. MaxText/tests/gcs.py starts it; the patches apply in its process only:

 1. objects.moveTo (gcsfs >= 2025 renames with POST .../o/{src}/moveTo/o/{dst}); stock answers
    501 and gcsfs retries with backoff ~33 s per file before falling back to copy+delete.
 2. objects.list startOffset/endOffset: TensorStore lists and DeleteRange()s ONLY through
    startOffset/endOffset (no `prefix`). Stock ignores them and returns the whole bucket, so a
    TensorStore delete_existing / DeleteRange wipes every object in the bucket.
 3. x-goog-generation / x-goog-metageneration headers on media downloads: TensorStore takes the
    object generation from them; without them it sees generation 0 and OCDBT fails with
    "Malformed StorageGeneration".
 4. ifGenerationMatch / ifGenerationNotMatch preconditions on get/download (412/304),
    media upload (412) and delete (412): TensorStore's conditional read/write protocol.
 5. A deeper listen backlog (stock http.server backlog is 5; TensorStore issues ~32
    concurrent requests; the server itself still handles one request at a time), and no
    traceback on stderr for client-closed connections (BrokenPipe after gcsfs cancels a
    racing request), which otherwise floods stderr (fills an unread pipe -> server blocks).

Usage (the command line of `python -m gcp_storage_emulator`):
  python3 gcs_emulator.py start --host 127.0.0.1 --port PORT --default-bucket B --in-memory -q
"""

import json
import sys
from http import HTTPStatus
from http import server as http_server

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main
from gcp_storage_emulator.exceptions import Conflict, NotFound
from gcp_storage_emulator.handlers import objects


class _Server(http_server.HTTPServer):
  request_queue_size = 1024

  def handle_error(self, request, client_address):
    # gcsfs cancels racing info()/ls requests, so the server sees BrokenPipe / reset when it
    # writes the response; benign. Stock prints a traceback to stderr for each one.
    if isinstance(sys.exc_info()[1], ConnectionError):
      return
    super().handle_error(request, client_address)


server.server = type("patched_http_server", (), {"HTTPServer": _Server})  # used by APIThread


def _q(request, key):
  v = request.query.get(key)
  return v[0] if v else None


def _current_generation(storage, bucket, name):
  try:
    return int(storage.get_file_obj(bucket, name).get("generation") or 0)
  except NotFound:
    return None


def _check(request, response, storage, bucket, name, kind):
  """Returns True when a precondition failed and the response is already set."""
  m, nm = _q(request, "ifGenerationMatch"), _q(request, "ifGenerationNotMatch")
  if m is None and nm is None:
    return False
  cur = _current_generation(storage, bucket, name)
  if m is not None:
    m = int(m)
    if m == 0:
      if cur is not None:
        response.status = HTTPStatus.PRECONDITION_FAILED
        return True
    elif cur is None and kind != "write":
      response.status = HTTPStatus.NOT_FOUND
      return True
    elif cur != m:
      response.status = HTTPStatus.PRECONDITION_FAILED
      return True
  if nm is not None and cur is not None and int(nm) == cur:
    response.status = HTTPStatus.NOT_MODIFIED if kind == "read" else HTTPStatus.PRECONDITION_FAILED
    return True
  return False


_orig = {f.__name__: f for f in (objects.get, objects.download, objects.insert, objects.delete, objects.ls)}


def download(request, response, storage, *args, **kwargs):
  p = request.params
  if _check(request, response, storage, p["bucket_name"], p["object_id"], "read"):
    return
  _orig["download"](request, response, storage, *args, **kwargs)
  if response.status in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
    gen = _current_generation(storage, p["bucket_name"], p["object_id"])
    response["x-goog-generation"] = str(gen)
    response["x-goog-metageneration"] = "1"


objects.download = download  # objects.get(alt=media) calls the module-level name


def get(request, response, storage, *args, **kwargs):
  p = request.params
  if _q(request, "alt") != "media" and _check(request, response, storage, p["bucket_name"], p["object_id"], "read"):
    return
  _orig["get"](request, response, storage, *args, **kwargs)


def insert(request, response, storage, *args, **kwargs):
  name = _q(request, "name")
  if name and _check(request, response, storage, request.params["bucket_name"], name, "write"):
    return
  _orig["insert"](request, response, storage, *args, **kwargs)


def delete(request, response, storage, *args, **kwargs):
  p = request.params
  if _check(request, response, storage, p["bucket_name"], p["object_id"], "write"):
    return
  _orig["delete"](request, response, storage, *args, **kwargs)


def ls(request, response, storage, *args, **kwargs):
  _orig["ls"](request, response, storage, *args, **kwargs)
  start, end = _q(request, "startOffset"), _q(request, "endOffset")
  if response.status != HTTPStatus.OK or (start is None and end is None):
    return
  body = json.loads(response._content)

  def keep(name):
    return (start is None or name >= start) and (end is None or name < end)

  body["items"] = [o for o in body.get("items", []) if keep(o["name"])]
  body["prefixes"] = [x for x in body.get("prefixes", []) if keep(x)]
  response.json(body)


def move(request, response, storage, *args, **kwargs):
  p = request.params
  try:
    dest = objects._copy(request.base_url, storage, p["bucket_name"], p["object_id"], p["bucket_name"], p["dest_object_id"])
    storage.delete_file(p["bucket_name"], p["object_id"])
    response.json(dest)
  except NotFound:
    response.status = HTTPStatus.NOT_FOUND
  except Conflict as err:
    objects._handle_conflict(response, err)


_replace = {
  _orig["get"]: get,
  _orig["download"]: download,
  _orig["insert"]: insert,
  _orig["delete"]: delete,
  _orig["ls"]: ls,
}
_MOVE = (
  r"/b/(?P<bucket_name>[-.\w]+)/o/(?P<object_id>.*[^/]+)/moveTo/o/"
  r"(?P<dest_object_id>.*[^/]+)$"
)
server.HANDLERS = (
  (r"^/storage/v1" + _MOVE, {server.POST: move}),
  (r"^" + _MOVE, {server.POST: move}),
  *((rx, {m: _replace.get(f, f) for m, f in h.items()}) for rx, h in server.HANDLERS),
)


def _exit_with_parent():
  """If GCS_EMULATOR_PARENT_PID is set, exit once that process is gone (a test runner killed
  with SIGKILL/SIGTERM never runs its cleanup, which would leave the emulator running)."""
  import os
  import threading
  import time

  parent = os.environ.get("GCS_EMULATOR_PARENT_PID")
  if not parent:
    return

  def watch():
    while os.getppid() == int(parent):
      time.sleep(0.5)
    os._exit(0)

  threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
  _exit_with_parent()
  sys.exit(main())

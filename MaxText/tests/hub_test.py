"""hf_model_path as a Hugging Face Hub id (MaxText/hub.py): a local folder passes through, an id resolves to its
snapshot in huggingface_hub's cache, and an id that cannot be had is refused in one line, quickly.

Never the network: the cache is a folder of tmp_path (built in huggingface_hub's layout, or filled by a download),
the Hub is offline (HF_HUB_OFFLINE), a loopback port that refuses or never answers, or FakeHub on loopback.
huggingface_hub reads its environment variables once, when it is imported (constants.py: this file imports it, and
so does transformers), so the in-process tests set its constants with monkeypatch; the command-line test sets the
variables of a subprocess.
"""

import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from huggingface_hub import constants

from MaxText import hub
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, deadline, free_port, run

REPO = "some-org/tiny-llama.v2"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty Hugging Face cache, the Hub offline (a test going online sets HF_HUB_OFFLINE back), its endpoint a
  closed loopback port."""
  folder = tmp_path / "hf-cache"
  folder.mkdir()
  monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # never the real Hub, even online
  monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))  # a file it caches
  return folder


def fake_snapshot(cache_dir, repo_id: str, files: dict[str, str]) -> str:
  """`files` ({name: path of its content}) cached as huggingface_hub lays out a download: the content in blobs/,
  snapshots/COMMIT/<name> a relative symlink to it, refs/main holding COMMIT. Returns the snapshot folder."""
  repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
  snapshot = os.path.join(repo, "snapshots", COMMIT)
  os.makedirs(os.path.join(repo, "blobs"))
  os.makedirs(os.path.join(repo, "refs"))
  with open(os.path.join(repo, "refs", "main"), "w") as f:
    f.write(COMMIT)
  for i, (name, source) in enumerate(sorted(files.items())):
    blob = os.path.join(repo, "blobs", f"blob{i}")
    shutil.copyfile(source, blob)
    link = os.path.join(snapshot, name)
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
  return snapshot


def assert_one_line_refusal(error: ConfigError, repo_id: str, *expected: str):
  message = str(error)
  assert "\n" not in message, message
  assert message.startswith(f"hf_model_path={repo_id} is not a local folder"), message
  for part in expected:
    assert part in message, message


def test_a_path_or_a_local_folder_passes_through_untouched(tmp_path, monkeypatch, cache):
  """A folder that exists is the folder, even one named like an id; a path that is not an id is left to the
  importer's own errors. Offline with an empty cache, none of them would resolve as an id: they are not tried."""
  monkeypatch.chdir(tmp_path)
  os.makedirs("owner/name")
  assert hub.model_folder("owner/name") == "owner/name"
  monkeypatch.setenv("HOME", str(tmp_path))
  assert hub.model_folder("~/owner/name") == str(tmp_path / "owner" / "name")
  for path in ("./absent/dir", "/absent/dir", "absent/dir/deeper", "absent/", "", "no-slash", "a--b/c", "x/y.git"):
    assert hub.model_folder(path) == path
  assert [v for v in ("owner/name", "Org_1/model-7B.v2", "a/b") if not hub.is_hub_id(v)] == []


def test_an_id_offline_and_not_cached_is_refused_in_one_line(cache):
  with pytest.raises(ConfigError) as e:
    hub.model_folder(REPO)
  assert_one_line_refusal(e.value, REPO, "HF_HUB_OFFLINE=1", f"hf download {REPO}", f"HF_HUB_CACHE={cache}")


def test_an_id_offline_resolves_to_its_cached_snapshot(tmp_path, cache, capsys):
  """Only what the importer reads is asked for: a cached snapshot holding config.json is complete for it."""
  config = tmp_path / "config.json"
  config.write_text('{"model_type": "llama"}')
  snapshot = fake_snapshot(cache, REPO, {"config.json": str(config)})
  assert hub.model_folder(REPO) == snapshot
  assert json.load(open(os.path.join(snapshot, "config.json"))) == {"model_type": "llama"}
  assert capsys.readouterr().out == f"hf_model_path={REPO}: Hugging Face Hub snapshot {COMMIT}, from the cache " + (
    f"(HF_HUB_OFFLINE=1), in {snapshot}\n"
  )


def test_an_incomplete_cached_snapshot_is_refused(tmp_path, cache):
  """huggingface_hub's cached listing of the commit (trees/COMMIT.json) names a file the snapshot lacks."""
  config = tmp_path / "config.json"
  config.write_text("{}")
  fake_snapshot(cache, REPO, {"config.json": str(config)})
  entry = {"size": 2, "blob_id": "b", "lfs_sha256": None, "lfs_size": None, "xet_hash": None}
  trees = os.path.join(cache, "models--" + REPO.replace("/", "--"), "trees")
  os.makedirs(trees)
  from huggingface_hub import _tree_cache

  listing = {"format_version": _tree_cache.TREE_CACHE_FORMAT_VERSION, "files": {"config.json": entry}}
  listing["files"]["model.safetensors"] = entry
  with open(os.path.join(trees, f"{COMMIT}.json"), "w") as f:
    json.dump(listing, f)
  if _tree_cache.read_tree_cache(os.path.dirname(trees), COMMIT) is None:
    pytest.fail("the listing written here is not one huggingface_hub reads: its format changed")
  with pytest.raises(ConfigError) as e:
    hub.model_folder(REPO)
  assert_one_line_refusal(e.value, REPO, "cached snapshot is incomplete", "HF_HUB_OFFLINE=1")


def test_an_unreachable_hub_is_refused_in_one_line_quickly(cache, monkeypatch):
  """Online, the Hub at a loopback port that refuses connections: no retries, refused at once."""
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  start = time.monotonic()
  with pytest.raises(ConfigError) as e, deadline(30):
    hub.model_folder(REPO)
  seconds = time.monotonic() - start
  assert_one_line_refusal(e.value, REPO, f"cannot be reached at {constants.ENDPOINT}", "Connection refused")
  assert seconds < 30, seconds  # 0.2 s here


def test_a_hub_that_never_answers_is_refused_after_the_etag_timeout(cache, monkeypatch):
  """A server that accepts the connection and never answers (huggingface_hub's own look-up would wait forever):
  refused after HF_HUB_ETAG_TIMEOUT, then the cached snapshot is looked for (none here)."""
  with socket.socket() as silent:
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    start = time.monotonic()
    with pytest.raises(ConfigError) as e, deadline(30):
      hub.model_folder(REPO)
    seconds = time.monotonic() - start
  assert_one_line_refusal(e.value, REPO, "cannot be reached", "Timeout")
  assert 1 <= seconds < 30, seconds


def test_a_cached_snapshot_is_used_when_the_hub_cannot_be_reached(tmp_path, cache, monkeypatch, capsys):
  """Online, the Hub refusing connections: the cached snapshot of main, and the line says why it was not asked."""
  config = tmp_path / "config.json"
  config.write_text("{}")
  snapshot = fake_snapshot(cache, REPO, {"config.json": str(config)})
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  assert hub.model_folder(REPO) == snapshot
  assert "from the cache (the Hugging Face Hub cannot be reached at http://127.0.0.1:" in capsys.readouterr().out


class FakeHub(BaseHTTPRequestHandler):
  """The Hub's answers that snapshot_download needs, for the repository `repo` (files: {name: bytes}) at COMMIT:
  its info, its file listing, each file's metadata (HEAD) and content. Anything else is a missing repository (404
  with the Hub's RepoNotFound code). `asked` records every path requested."""

  repo: str = REPO
  files: dict[str, bytes] = {}
  asked: list[str] = []

  def do_HEAD(self):
    self.do_GET()

  def do_GET(self):
    path = urllib.parse.urlparse(self.path).path
    self.asked.append(path)
    if path in (f"/api/models/{self.repo}", f"/api/models/{self.repo}/revision/main"):
      self.answer(json.dumps({"id": self.repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in self.files]}))
    elif path == f"/api/models/{self.repo}/tree/{COMMIT}":
      oid = {n: hashlib.sha1(b).hexdigest() for n, b in self.files.items()}
      self.answer(json.dumps([{"type": "file", "path": n, "size": len(b), "oid": oid[n]} for n, b in self.files.items()]))
    elif path.startswith(f"/{self.repo}/resolve/{COMMIT}/") and path.split("/", 5)[-1] in self.files:
      body = self.files[path.split("/", 5)[-1]]
      self.answer(body, {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(body).hexdigest()}"'})
    else:
      self.send_response(404)
      self.send_header("X-Error-Code", "RepoNotFound")
      self.send_header("Content-Length", "0")
      self.end_headers()

  def answer(self, body, headers=None):
    body = body.encode() if isinstance(body, str) else body
    self.send_response(200)
    for name, value in (headers or {}).items():
      self.send_header(name, value)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command == "GET":
      self.wfile.write(body)

  def log_message(self, *args):
    pass


@pytest.fixture
def fake_hub(cache, monkeypatch):
  """FakeHub on a loopback port, as huggingface_hub's endpoint (its API and its file URLs), online."""
  monkeypatch.setattr(FakeHub, "files", {})
  monkeypatch.setattr(FakeHub, "asked", [])
  server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  endpoint = f"http://127.0.0.1:{server.server_address[1]}"
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
  monkeypatch.setattr(constants, "ENDPOINT", endpoint)
  monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
  yield FakeHub
  server.shutdown()
  server.server_close()


def test_an_id_is_fetched_into_the_cache_with_only_what_the_importer_reads(fake_hub, cache, monkeypatch, capsys):
  """Online: the files the importer reads are downloaded into the cache's snapshot (pickled weights and the README
  are not); the next run finds them there, online or offline."""
  fake_hub.files.update(
    {"config.json": b"{}", "model.safetensors": b"weights", "pytorch_model.bin": b"pickle", "README.md": b"hi"}
  )
  snapshot = os.path.join(cache, "models--" + REPO.replace("/", "--"), "snapshots", COMMIT)
  assert hub.model_folder(REPO) == snapshot
  assert sorted(os.listdir(snapshot)) == ["config.json", "model.safetensors"]
  assert open(os.path.join(snapshot, "model.safetensors"), "rb").read() == b"weights"
  assert not [p for p in fake_hub.asked if p.endswith(("pytorch_model.bin", "README.md"))], fake_hub.asked
  assert f"snapshot {COMMIT}, 2 files fetched, in {snapshot}\n" in capsys.readouterr().out
  assert hub.model_folder(REPO) == snapshot
  assert f"snapshot {COMMIT}, up to date in the cache, in {snapshot}\n" in capsys.readouterr().out
  monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
  assert hub.model_folder(REPO) == snapshot


def test_the_repository_missing_on_the_hub_says_so(fake_hub):
  """The Hub answers 404 with its RepoNotFound code: no such repository, or a private one that needs a token."""
  with pytest.raises(ConfigError) as e:
    hub.model_folder("some-org/absent")
  assert_one_line_refusal(e.value, "some-org/absent", "the Hub has no such repository, or it is private", "HF_TOKEN")


def test_the_importer_takes_an_id_and_writes_what_the_folder_gives(tmp_path, cache, capsys):
  """convert_hf_checkpoint.py with hf_model_path=<id> (a cached snapshot, offline) writes the checkpoint that the same
  files as a folder give: the same arrays (checksums of their bytes), model.yml and tokenizer files."""
  from MaxText.tests.hf_checkpoint_test import CHAT_VOCAB, import_hf, save_chat_tokenizer, save_random

  folder = tmp_path / "hf"
  save_random("llama", str(folder), vocab_size=CHAT_VOCAB)
  save_chat_tokenizer(str(folder))
  files = {name: str(folder / name) for name in os.listdir(folder)}
  assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(files)
  fake_snapshot(cache, REPO, files)
  by_id = import_hf(REPO, str(tmp_path / "by_id"))
  assert f"hf_model_path={REPO}: Hugging Face Hub snapshot {COMMIT}" in capsys.readouterr().out
  by_folder = import_hf(str(folder), str(tmp_path / "by_folder"))

  def read(ckpt, name, parse=None):
    with open(os.path.join(ckpt, name), encoding="utf-8") as f:
      return parse(f) if parse else f.read()

  checksums = read(by_id, os.path.join("checksums", "metadata"), json.load)["arrays"]
  assert any("token_embedder" in name for name in checksums), sorted(checksums)
  assert checksums == read(by_folder, os.path.join("checksums", "metadata"), json.load)["arrays"]
  assert read(by_id, "model.yml", yaml.safe_load) == read(by_folder, "model.yml", yaml.safe_load)
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert read(by_id, name) == read(by_folder, name), name


@pytest.mark.slow
def test_the_command_line_refuses_an_unreachable_id_in_one_line(tmp_path):
  """convert_hf_checkpoint.py hf_model_path=<id>, offline, empty cache: exit 2, one line on stderr, nothing written."""
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  script = os.path.join(REPO_ROOT, "MaxText", "convert_hf_checkpoint.py")
  out = tmp_path / "out"
  args = [f"hf_model_path={REPO}", f"base_output_directory={out}", "run_name=imported", "jax_cache_dir="]
  done = run([sys.executable, script, BASE_YML, *args], env, timeout=120, cwd=tmp_path)
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr[-3000:]
  assert lines[0].startswith(f"error: hf_model_path={REPO} is not a local folder"), lines[0]
  assert "HF_HUB_OFFLINE=1" in lines[0], lines[0]
  assert not os.path.exists(out / "imported" / "checkpoints")

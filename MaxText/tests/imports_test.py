"""The import graph of MaxText/ (tests aside): one-way, and no module imports an entry-point script.

Read from the source (every import statement, including those inside functions), so a lazy import that
closes a cycle counts too. Importing `MaxText.a.b` also imports the package `MaxText.a` (except from inside it).
"""

import ast
import os

from MaxText.tests.helpers import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "MaxText")


def _modules() -> dict[str, str]:
  """Module name -> file, for every module under MaxText/ but the tests."""
  found = {}
  for folder, dirs, files in os.walk(PACKAGE):
    dirs[:] = [d for d in dirs if d not in ("tests", "__pycache__", "configs")]
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        parts = os.path.relpath(path, REPO_ROOT)[: -len(".py")].split(os.sep)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def _imports(path: str, modules: dict[str, str]) -> set[str]:
  """The MaxText modules a file imports (with their parent packages)."""
  targets = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      targets |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      targets |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
  found = set()
  for name in targets:
    parts = name.split(".")
    found |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)} & set(modules)
  return found


def _graph() -> dict[str, set[str]]:
  """Module -> the modules it imports; a module's own packages are left out (they are already importing it)."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    graph[name] = {n for n in _imports(path, modules) if n != name and not name.startswith(n + ".")}
  return graph


def _entry_points(modules: dict[str, str]) -> set[str]:
  return {name for name, path in modules.items() if 'if __name__ == "__main__":' in open(path, encoding="utf-8").read()}


def _reachable(graph, start: str) -> set[str]:
  seen, todo = set(), [start]
  while todo:
    for nxt in graph[todo.pop()] - seen:
      seen.add(nxt)
      todo.append(nxt)
  return seen


# The one exception: train_compile.py compiles train.py's own step (the same function and shardings), not a copy.
ALLOWED = {("MaxText.train_compile", "MaxText.train")}


def test_no_module_imports_an_entry_point():
  modules = _modules()
  scripts = _entry_points(modules)
  assert {"MaxText.train", "MaxText.decode", "MaxText.convert_hf_checkpoint", "MaxText.train_compile"} <= scripts
  for name, imported in _graph().items():
    imported_scripts = {script for script in imported & scripts if (name, script) not in ALLOWED}
    assert not imported_scripts, f"{name} imports the script(s) {sorted(imported_scripts)}"


def test_the_import_graph_has_no_cycle():
  graph = _graph()
  state = dict.fromkeys(graph, "new")

  def visit(name, path):
    state[name] = "open"
    for nxt in sorted(graph[name]):
      assert state[nxt] != "open", f"import cycle: {' -> '.join([*path, name, nxt])}"
      if state[nxt] == "new":
        visit(nxt, [*path, name])
    state[name] = "done"

  for name in sorted(graph):
    if state[name] == "new":
      visit(name, [])


def test_layers_and_config_come_before_state_checkpointing_and_scripts():
  """config types -> layers (and the family registry) -> pyconfig -> state/checkpointing -> cli -> scripts."""
  graph = _graph()
  scripts = _entry_points(_modules())
  above_layers = {"MaxText.pyconfig", "MaxText.state", "MaxText.checkpointing", "MaxText.cli", "MaxText.optimizers"}
  for layer in [name for name in graph if name.startswith("MaxText.layers")] + ["MaxText.families"]:
    assert not _reachable(graph, layer) & (above_layers | scripts), (
      f"{layer} reaches {_reachable(graph, layer) & above_layers}"
    )
  assert not _reachable(graph, "MaxText.pyconfig") & {"MaxText.state", "MaxText.checkpointing", "MaxText.cli", *scripts}
  assert not _reachable(graph, "MaxText.common_types")

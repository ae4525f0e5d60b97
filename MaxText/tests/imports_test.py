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


def test_no_module_imports_an_entry_point():
  """No exception: what two scripts share lives in a library module (train.py's and train_compile.py's step in
  step.py)."""
  modules = _modules()
  scripts = _entry_points(modules)
  assert {"MaxText.train", "MaxText.decode", "MaxText.convert_hf_checkpoint", "MaxText.train_compile"} <= scripts
  for name, imported in _graph().items():
    assert not imported & scripts, f"{name} imports the script(s) {sorted(imported & scripts)}"


def test_the_step_checkpointing_and_cli_reach_no_entry_point():
  """The modules the scripts share (the step, checkpointing with its disk policy, the command-line code with its
  signal handling) reach no script, even through the modules they import; and train_compile.py gets the step it
  compiles from step.py, as train.py does."""
  graph = _graph()
  scripts = _entry_points(_modules())
  shared = ("MaxText.step", "MaxText.checkpointing", "MaxText.cli")
  assert not set(shared) & scripts
  for name in shared:
    assert not _reachable(graph, name) & scripts, f"{name} reaches the script(s) {sorted(_reachable(graph, name) & scripts)}"
  assert "MaxText.step" in graph["MaxText.train_compile"] and "MaxText.step" in graph["MaxText.train"]


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


def test_the_families_sit_below_the_layers():
  """Families -> layers is one way: the family registry and its modules (which the registry imports by listing its
  folder, invisible to this graph) reach no layer, naming their layer classes by import path instead; the layers
  reach the families' registry (layers/decoders.py finds a layer class through it) and, of the conversion code, only
  the mapping types the families declare (convert/hf_families.py); and the families stay below pyconfig."""
  graph = _graph()
  family_modules = [name for name in graph if name == "MaxText.families" or name.startswith("MaxText.families.")]
  assert "MaxText.families.llama2" in family_modules
  above = {"MaxText.pyconfig", "MaxText.state", "MaxText.checkpointing", "MaxText.cli", *_entry_points(_modules())}
  for module in family_modules:
    reached = _reachable(graph, module)
    layers = sorted(n for n in reached if n == "MaxText.layers" or n.startswith("MaxText.layers."))
    assert not layers, f"{module} reaches {layers}"
    assert not reached & above, f"{module} reaches {reached & above}"
  layers = [name for name in graph if name == "MaxText.layers" or name.startswith("MaxText.layers.")]
  assert "MaxText.layers.models" in layers and "MaxText.layers.decoders" in layers
  for layer in layers:
    mapping = {"MaxText.convert", "MaxText.convert.hf_families"}  # (importing a module imports its package)
    converts = {n for n in _reachable(graph, layer) if n.startswith("MaxText.convert")} - mapping
    assert not converts, f"{layer} reaches {sorted(converts)}"


def test_the_config_layer_imports_no_implementation():
  """Reading a config needs neither jax nor flax (pyconfig_test reads every preset in a fresh interpreter to check):
  the config layer reaches the components' jax-free sections, the family registry, the kernels' capability table and
  the objectives' registry, never the layers (kernels included), the inference engine, the server, RL, or an
  objective's implementation."""
  graph = _graph()
  config_layer = ["MaxText.pyconfig", "MaxText.config_parse", "MaxText.config_validate", "MaxText.config_derive"]
  forbidden = ("MaxText.layers", "MaxText.inference", "MaxText.server", "MaxText.rl", "MaxText.objectives.")
  for module in config_layer:
    reached = sorted(n for n in _reachable(graph, module) if n.startswith(forbidden))
    assert not reached, f"{module} reaches {reached}"
  sections = [name for name in graph if name.startswith("MaxText.sections")]
  assert "MaxText.sections.optimizer" in sections
  for module in [*sections, "MaxText.kernel_capabilities", "MaxText.objectives"]:
    reached = sorted(n for n in _reachable(graph, module) if n.startswith(forbidden))
    assert not reached, f"{module} reaches {reached}"


# docs/explanations/architecture.md's rows, from the bottom: a module is in the first row naming it or its package
# (a prefix ending in "." names a package's modules, not the package); the rest are the model row's.
ROWS = [
  ("bottom", ("MaxText.common_types", "MaxText.storage", "MaxText.chat_template", "MaxText.convert.hf_families")),
  ("config", ("MaxText.pyconfig", "MaxText.config_", "MaxText.sections", "MaxText.kernel_capabilities", "MaxText.families")),
  ("model", ()),
  ("run set-up", ("MaxText.cli", "MaxText.state", "MaxText.checkpointing")),
  ("serving", ("MaxText.server", "MaxText.inference", "MaxText.rl")),
  ("loop", ("MaxText.step", "MaxText.objectives.")),
]


def _row(module: str, scripts: set[str]) -> int:
  if module in scripts:
    return len(ROWS)
  if module in ("MaxText.convert", "MaxText.objectives"):  # the packages of bottom and config modules
    return 0 if module == "MaxText.convert" else 1
  for i, (_, prefixes) in enumerate(ROWS):
    if prefixes and module.startswith(prefixes):
      return i
  return 2


def test_the_order_the_architecture_page_gives():
  """docs/explanations/architecture.md's layout: scripts -> loop -> serving -> run set-up -> model -> config ->
  bottom; no module imports from a row above its own."""
  graph = _graph()
  scripts = _entry_points(_modules())
  up = sorted(f"{a} -> {b}" for a in graph for b in graph[a] if _row(b, scripts) > _row(a, scripts))
  assert not up, up
  assert {"MaxText.pyconfig"} <= _reachable(graph, "MaxText.step") and "MaxText.cli" in _reachable(graph, "MaxText.step")

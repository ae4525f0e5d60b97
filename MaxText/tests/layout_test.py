"""Tests mirror modules. A module of MaxText/ is tested in `MaxText/tests/<name>_test.py` (for a module of a
subpackage, `<package>_<name>_test.py` also counts: rl/loss.py in rl_loss_test.py), or a line below says where:

- TESTED_IN: the test files that import it or run it as a file (they name its path), for a module whose tests live
  beside a larger subject's (the inference engine's pages and sampling in engine_test.py) or are shared;
- THROUGH: the public module that the tests call for it, for the parts of one (pyconfig's parse, derive and
  validate; the attention kernels behind layers/attention_kernels.py; the modules of the checkpointing package,
  whose names its __init__ gives);
- a model family's two modules (families/<name>.py and the decoder layer it registers) are tested through the
  registry: every registered family's Hugging Face examples run against transformers (hf_checkpoint_test.py), and
  it must have one.

Each line is checked against the test files' imports, so the map cannot go stale: a new module fails here until it
has its own test file or a line, and a line for a module that has since got its own file, or no longer exists,
fails too.
"""

import ast
import os

import pytest

from MaxText import families
from MaxText.tests.helpers import REPO_ROOT

PACKAGE = os.path.join(REPO_ROOT, "MaxText")
TESTS = os.path.join(PACKAGE, "tests")

TESTED_IN = {
  "MaxText.common_types": ("pyconfig_test.py", "sharding_rules_test.py"),
  "MaxText.compiled_step": ("train_compile_test.py", "train_test.py"),
  "MaxText.convert.hf_families": ("families_test.py", "import_fuzz_test.py", "moe_test.py"),
  "MaxText.convert.mxfp4": ("gpt_oss_test.py",),
  "MaxText.convert.peft": ("lora_test.py", "convert_test.py"),
  "MaxText.convert.streaming": ("gpt_oss_test.py",),
  "MaxText.convert_hf_checkpoint": ("hf_checkpoint_test.py", "convert_test.py", "import_fuzz_test.py"),
  "MaxText.convert_to_hf_checkpoint": ("hf_checkpoint_test.py", "convert_test.py", "lora_test.py"),
  "MaxText.decode": ("inference_test.py", "cli_test.py", "tokenizer_test.py"),
  "MaxText.generate_hf_golden_logits": ("logit_checker_test.py",),
  "MaxText.generate_param_only_checkpoint": ("inference_test.py", "deepseek_test.py"),
  "MaxText.inference.pages": ("engine_test.py",),
  "MaxText.inference.model_runner": ("engine_test.py",),
  "MaxText.inference.request": ("output_test.py", "scheduler_test.py", "server_bridge_test.py"),
  "MaxText.inference.slots": ("engine_test.py",),
  "MaxText.inference.prompts": ("inference_test.py", "serve_test.py", "sft_test.py"),
  "MaxText.inference.sampling": ("inference_test.py", "engine_test.py"),
  "MaxText.inference_microbenchmark": ("inference_test.py",),
  "MaxText.input_pipeline.synthetic": ("train_test.py",),
  "MaxText.input_pipeline.text_pipeline": ("input_pipeline_test.py", "sft_test.py", "dpo_test.py"),
  "MaxText.layers.attention_masks": ("attention_kernels_test.py", "llama4_test.py"),
  "MaxText.layers.attention_mla": ("deepseek_test.py",),
  "MaxText.layers.attention_splash": ("attention_kernels_test.py", "context_parallel_test.py"),
  "MaxText.layers.attentions": ("attention_kernels_test.py",),
  "MaxText.layers.decoders": ("families_test.py",),
  "MaxText.layers.embeddings": ("model_test.py", "llama4_test.py"),
  "MaxText.layers.kv_cache": ("kv_quant_test.py",),
  "MaxText.layers.linears": ("quantization_test.py",),
  "MaxText.layers.models": ("model_test.py", "checkpointing_test.py", "engine_test.py"),
  "MaxText.layers.quantizations": ("quantization_test.py", "quantized_inference_test.py"),
  "MaxText.rl.rollouts": ("rl_test.py",),
  "MaxText.script_path": ("cli_test.py",),
  "MaxText.sections.adapters": ("sections_test.py",),
  "MaxText.sections.context_parallelism": ("sections_test.py",),
  "MaxText.sections.data": ("sections_test.py",),
  "MaxText.sections.decoding": ("sections_test.py",),
  "MaxText.sections.layers": ("sections_test.py",),
  "MaxText.sections.optimizer": ("sections_test.py",),
  "MaxText.sections.preference": ("sections_test.py",),
  "MaxText.sections.profiler": ("sections_test.py",),
  "MaxText.sections.quantize": ("sections_test.py",),
  "MaxText.sections.reinforcement": ("sections_test.py",),
  "MaxText.sections.router": ("sections_test.py",),
  "MaxText.sections.serving": ("sections_test.py",),
  "MaxText.server.app": ("serve_test.py",),
  "MaxText.server.options": ("serve_test.py",),
  "MaxText.server.run": ("serve_test.py",),
  "MaxText.standalone_dataloader": ("cli_test.py",),
  "MaxText.objectives.base": ("objectives_test.py",),
  "MaxText.objectives.lm": ("objectives_test.py", "model_test.py", "input_pipeline_test.py"),
  "MaxText.objectives.losses": ("train_test.py", "rl_loss_test.py", "sft_test.py"),
  "MaxText.step": ("train_test.py", "dpo_test.py", "objectives_test.py"),
  "MaxText.storage": ("gcs_test.py", "cli_test.py"),
  "MaxText.tpu_topology": ("train_compile_test.py",),
  "MaxText.train_tokenizer": ("tokenizer_test.py", "detokenize_test.py", "hf_checkpoint_test.py"),
}

THROUGH = {
  "MaxText.checkpointing.adapters": ("MaxText.checkpointing", ("checkpointing_test.py", "lora_test.py")),
  "MaxText.checkpointing.compatible": ("MaxText.checkpointing", ("checkpointing_test.py", "lora_test.py")),
  "MaxText.checkpointing.damage": ("MaxText.checkpointing", ("checkpointing_test.py",)),
  "MaxText.checkpointing.disk": ("MaxText.checkpointing", ("checkpointing_test.py",)),
  "MaxText.checkpointing.paths": ("MaxText.checkpointing", ("checkpointing_test.py",)),
  "MaxText.checkpointing.processes": ("MaxText.checkpointing", ("checkpointing_test.py",)),
  "MaxText.checkpointing.restore": ("MaxText.checkpointing", ("checkpointing_test.py", "lora_test.py")),
  "MaxText.checkpointing.save": ("MaxText.checkpointing", ("checkpointing_test.py", "lora_test.py")),
  "MaxText.config_parse": ("MaxText.pyconfig", ("pyconfig_test.py", "fuzz_config_test.py")),
  "MaxText.config_derive": ("MaxText.pyconfig", ("pyconfig_test.py", "fuzz_config_test.py")),
  "MaxText.config_validate": ("MaxText.pyconfig", ("pyconfig_test.py", "fuzz_config_test.py")),
  "MaxText.convert.spm_tokenizer": ("MaxText.convert_to_hf_checkpoint", ("hf_checkpoint_test.py", "convert_test.py")),
  "MaxText.layers.attention_blockwise": ("MaxText.layers.attention_kernels", ("attention_kernels_test.py",)),
  "MaxText.layers.attention_cudnn": ("MaxText.layers.attention_kernels", ("attention_kernels_test.py",)),
  "MaxText.server.chat": ("MaxText.server.app", ("serve_test.py",)),
  "MaxText.server.completions": ("MaxText.server.app", ("serve_test.py",)),
  "MaxText.server.info": ("MaxText.server.app", ("serve_test.py",)),
  "MaxText.server.protocol": ("MaxText.server.app", ("serve_test.py",)),
  "MaxText.server.service": ("MaxText.server.app", ("serve_test.py",)),
}


def modules() -> list[str]:
  """Every module of the package (`MaxText.x.y`), tests and `__init__` files aside."""
  names = []
  for folder, subfolders, files in os.walk(PACKAGE):
    subfolders[:] = sorted(d for d in subfolders if d not in ("tests", "__pycache__"))
    for name in sorted(files):
      if name.endswith(".py") and name != "__init__.py":
        names.append(os.path.relpath(os.path.join(folder, name[:-3]), REPO_ROOT).replace(os.sep, "."))
  return names


def imported(path: str) -> set[str]:
  """The MaxText modules a file imports (`from MaxText.x import y` counts as MaxText.x and MaxText.x.y)."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return {name for name in names if name.startswith("MaxText")}


def own_test_files(module: str) -> list[str]:
  """The mirror names of a module: <name>_test.py, and <package>_<name>_test.py inside a subpackage."""
  parts = module.split(".")[1:]
  names = [f"{parts[-1]}_test.py"] + ([f"{'_'.join(parts[-2:])}_test.py"] if len(parts) > 1 else [])
  return [name for name in names if os.path.isfile(os.path.join(TESTS, name))]


def reaches(test_file: str, module: str) -> bool:
  """The test file imports the module, or runs it as a file (names its path)."""
  path = os.path.join(TESTS, test_file)
  with open(path, encoding="utf-8") as f:
    named = module.replace(".", "/") + ".py" in f.read()
  return module in imported(path) or named


def family_modules() -> dict[str, str]:
  """families/<name>.py and the module of the decoder layer(s) it registers -> the family's name."""
  found = {}
  for name, family in families.FAMILIES.items():
    found[f"MaxText.families.{name}"] = name
    for layer in (family.layer_class, family.layer_class.dense_layer):
      if layer is not None:
        found.setdefault(layer.__module__, name)
  return found


def test_every_module_has_its_tests_named():
  by_family = family_modules()
  missing = [
    m for m in modules() if not own_test_files(m) and m not in TESTED_IN and m not in THROUGH and m not in by_family
  ]
  assert not missing, f"give each its own test file (MaxText/tests/<name>_test.py) or a line in TESTED_IN: {missing}"


def test_no_line_is_stale():
  every = set(modules())
  stale = sorted((set(TESTED_IN) | set(THROUGH)) - every)
  assert not stale, f"{stale} no longer exist: drop their lines"
  mirrored = sorted(m for m in (set(TESTED_IN) | set(THROUGH)) if own_test_files(m))
  assert not mirrored, f"{mirrored} have their own test files now: drop their lines"


@pytest.mark.parametrize("module", sorted(TESTED_IN))
def test_the_named_files_test_the_module(module):
  absent = [t for t in TESTED_IN[module] if not reaches(t, module)]
  assert not absent, f"{absent} neither import {module} nor run it as a file"


@pytest.mark.parametrize("module", sorted(THROUGH))
def test_the_public_module_uses_the_part_its_tests_call(module):
  public, test_files = THROUGH[module]
  path = os.path.join(REPO_ROOT, *public.split("."))
  path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"  # a package: its __init__.py
  assert module in imported(path), f"{public} does not import {module}"
  absent = [t for t in test_files if public not in imported(os.path.join(TESTS, t))]
  assert not absent, f"{absent} do not import {public}"


def test_every_family_runs_against_transformers():
  """A family's modules are mirrored by the registry's parity tests only if it has an example to run."""
  with open(os.path.join(TESTS, "hf_checkpoint_test.py"), encoding="utf-8") as f:
    assert "families.FAMILIES" in f.read()
  no_example = sorted(name for name, family in families.FAMILIES.items() if family.hf and not family.hf_examples)
  assert not no_example, no_example
  untested = sorted(name for name, family in families.FAMILIES.items() if not family.hf)
  assert not untested, f"{untested} have no Hugging Face mapping, so no parity test: give them their own test files"


def test_each_own_test_file_tests_its_module():
  """(A family's own test file, deepseek_test.py, reaches its modules through the registry: model_name=deepseek.)"""
  by_family = family_modules()
  absent = [(m, own_test_files(m)) for m in modules() if own_test_files(m) and m not in by_family]
  absent = [(m, files) for m, files in absent if not any(reaches(f, m) for f in files)]
  assert not absent, f"these test files neither import their module nor run it as a file: {absent}"

"""The config's sections (MaxText/sections/): each key of one section and of base.yml, each component's list of valid
values the section's own object, each section's check run by pyconfig, and the package importable with neither
jax nor flax."""

import subprocess
import sys

import pytest
import yaml

from MaxText import config_validate, input_pipeline, lora, metrics, optimizers, pyconfig, sections
from MaxText.common_types import ConfigError
from MaxText.inference import sampling
from MaxText.input_pipeline import tokenizer
from MaxText.layers import context_parallel, embeddings, linears, models, quantizations
from MaxText.rl import loss as rl_loss
from MaxText.rl import rewards
from MaxText.sections import (
  adapters,
  context_parallelism,
  data,
  decoding,
  layers,
  optimizer,
  preference,
  profiler,
  quantize,
  reinforcement,
  router,
  serving,
)
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config


def _base_keys() -> set[str]:
  with open(BASE_YML, encoding="utf-8") as f:
    return set(yaml.safe_load(f))


def test_the_package_lists_its_modules():
  """Every module of the package is a section, found by listing it (the test imports each by name above)."""
  modules = [adapters, context_parallelism, data, decoding, layers, optimizer, preference, profiler, quantize]
  modules += [reinforcement, router, serving]
  assert sorted(sections.SECTIONS) == sorted(m.__name__.rsplit(".", 1)[1] for m in modules)
  assert [s.name for s in sections.all()] == sorted(sections.SECTIONS)
  assert all(sections.SECTIONS[m.SECTION.name] is m.SECTION for m in modules)


def test_every_key_is_in_base_yml_and_in_one_section():
  base, owner = _base_keys(), {}
  for section in sections.all():
    assert len(set(section.keys)) == len(section.keys), f"{section.name} names a key twice"
    missing = [key for key in section.keys if key not in base]
    assert not missing, f"section {section.name} names keys base.yml lacks: {missing}"
    for key in section.keys:
      assert key not in owner, f"{key} is in sections {owner.get(key)} and {section.name}"
      owner[key] = section.name
    unowned = [key for key in section.choices if key not in section.keys]
    assert not unowned, f"section {section.name} gives choices of keys it does not name: {unowned}"


def test_the_components_lists_are_the_sections():
  """A component's valid values are its section's object, or a registry of implementations keyed by exactly its
  names in its order, so no list of names exists twice."""
  same = [
    (quantizations.QUANTIZATIONS, quantize.QUANTIZATIONS),
    (quantizations.KV_QUANT_AXES, quantize.KV_QUANT_AXES),
    (input_pipeline.DATASET_TYPES, data.DATASET_TYPES),
    (metrics.PROFILERS, profiler.PROFILERS),
    (sampling.STRATEGIES, decoding.STRATEGIES),
    (embeddings.ROPE_TYPES, layers.ROPE_TYPES),
    (linears.CLAMPED_SWIGLU, layers.CLAMPED_SWIGLU),
    (rl_loss.ALGOS, reinforcement.ALGOS),
    (rl_loss.AGG_MODES, reinforcement.AGG_MODES),
    (lora.HF_NAMES, adapters.HF_NAMES),
  ]
  for component, section in same:
    assert component is section, (component, section)
  keyed = [
    (optimizers.OPTIMIZERS, optimizer.OPTIMIZERS),
    (linears.DTYPES, layers.DTYPES),
    (linears.PRECISIONS, layers.PRECISIONS),
    (linears.ACTIVATIONS, layers.ACTIVATIONS),
    (models.REMAT_POLICIES, layers.REMAT_POLICIES),
    (tokenizer.LOADERS, data.TOKENIZER_TYPES),
    (quantizations.TRAINING, quantize.TRAINING),
    (quantizations.WEIGHT_ONLY, quantize.WEIGHT_ONLY),
    (quantizations.TARGETS, quantize.TARGETS),
    (quantizations.KV_QUANT_DTYPES, quantize.KV_QUANT_DTYPES),
    (rewards.BUILTINS, reinforcement.BUILTIN_REWARDS),
    (input_pipeline.TEXT_SOURCES, data.TEXT_SOURCES),
  ]
  for registry, names in keyed:
    assert tuple(registry) == names, (tuple(registry), names)


def test_the_registries_hold_what_the_names_say():
  """The implementations built from the names alone are the ones jax names so (an independent spelling)."""
  import jax  # noqa: PLC0415 (the other tests of this file need no jax)
  import jax.numpy as jnp  # noqa: PLC0415

  assert linears.DTYPES == {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
  assert linears.PRECISIONS == {
    "default": jax.lax.Precision.DEFAULT,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
  }
  assert quantizations.KV_QUANT_DTYPES == {"int8": jnp.int8}


def test_implement_refuses_a_name_without_its_implementation():
  with pytest.raises(ValueError, match="do not match the section's names"):
    sections.implement(("a", "b"), {"a": 1})
  with pytest.raises(ValueError, match="do not match the section's names"):
    sections.implement(("a",), {"a": 1, "b": 2})
  assert list(sections.implement(("b", "a"), {"a": 1, "b": 2})) == ["b", "a"]


def test_choices_merges_every_sections_choices():
  merged = pyconfig.choices()
  for section in sections.all():
    for key, valid in section.choices.items():
      assert merged[key] is valid, key


@pytest.mark.parametrize(
  ("override", "fragment"),
  [
    ("override_model_config=true mlp_activations=['silu','swish']", "mlp_activations contains 'swish'; choose among silu"),
    ("n_routing_groups=2", "n_routing_groups applies to sigmoid routing"),
    ("muon_beta=1.0", "muon_beta=1.0 must be in [0, 1)"),
    ("lora_rank=-1", "lora_rank=-1 is negative"),
    ("weight_quantization_calibration_method=fixed,1,2", "a fixed range must contain 0"),
    ("dpo_beta=0", "dpo_beta=0.0 must be > 0"),
    ("grpo_epsilon=1.5", "grpo_epsilon=1.5 in (0, 1)"),
    ("reward_functions=['exact-match']", "did you mean 'exact_match'?"),
  ],
)
def test_each_sections_check_runs_when_a_config_is_read(override, fragment):
  """pyconfig refuses what a section's check refuses, in one line (the rules moved to the sections still run)."""
  with pytest.raises(ConfigError) as error:
    config(*override.split(" "))
  assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_section_check_sees_the_model_dimensions():
  """LoRA's rank is checked against emb_dim, head_dim and mlp_dim, which config_validate adds to the values."""
  values = {key: None for key in adapters.SECTION.keys}
  values |= {"lora_rank": 8, "lora_alpha": 16.0, "lora_target_modules": ["query"], "emb_dim": 64, "head_dim": 8}
  values |= {"mlp_dim": 128}
  with pytest.raises(ConfigError, match=r"lora_rank=8 is not below the model's smallest projection width \(8\)"):
    adapters.check(values)
  adapters.check(values | {"head_dim": 16})


def test_config_validate_reads_the_sections_not_the_components():
  """config_validate takes the valid values and rules from the sections: no module of the components listed here."""
  imported = {id(value) for value in vars(config_validate).values()}
  components = [optimizers, lora, metrics, input_pipeline, tokenizer, sampling, linears, models, embeddings]
  components += [context_parallel, quantizations, rl_loss, rewards]
  assert not [m.__name__ for m in components if id(m) in imported]


def test_importing_the_sections_loads_neither_jax_nor_flax():
  code = (
    "import sys, MaxText.sections as s; s.all(); "
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax', 'optax', 'numpy'}))"
  )
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""The layers' section (layers/linears.py, models.py, embeddings.py): the dtypes, the matmul precision, the MLP's
activations, the remat policy and the rotary embeddings' frequencies."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError, shown
from MaxText.sections import Section

# `dtype`, `weight_dtype` (and the optimizer's mu_dtype): jax.numpy's dtypes of these names (linears.DTYPES).
DTYPES = ("bfloat16", "float32", "float16")
# `matmul_precision`: jax.lax.Precision's members of these names, upper-cased (linears.PRECISIONS).
PRECISIONS = ("default", "high", "highest")
# `mlp_activations`: one per input projection of the MLP (linears.ACTIVATIONS gives their functions).
ACTIVATIONS = ("silu", "gelu", "relu", "tanh", "sigmoid", "linear")
# gpt-oss's clamped SwiGLU (mlp_activations_limit > 0): its activations.
CLAMPED_SWIGLU = ("sigmoid", "linear")
SWIGLU_ALPHA = 1.702  # the clamped SwiGLU's gate: x * sigmoid(SWIGLU_ALPHA * x) (gpt-oss)
# `remat_policy`: what the backward pass keeps of the forward pass (models.REMAT_POLICIES gives the jax policies).
REMAT_POLICIES = (
  "full",
  "minimal",
  "minimal_flash",
  "save_qkv_proj",
  "save_dot_except_mlp",
  "save_dot_except_mlpwi",
  "save_out_proj",
  "qkv_proj_offloaded",
  "minimal_offloaded",
  "none",
)
ROPE_TYPES = ("default", "llama3.1", "yarn")  # `rope_type`: RoFormer's frequencies, or scaled as Llama 3.1 or YaRN


def check(values: Mapping) -> None:
  if not values["mlp_activations"]:
    raise ConfigError("mlp_activations=[] is empty; give at least one activation, e.g. ['silu','linear']")
  for act in values["mlp_activations"]:
    if act not in ACTIVATIONS:
      raise ConfigError(f"mlp_activations contains {shown(act)}; choose among {', '.join(ACTIVATIONS)}")


SECTION = Section(
  name="layers",
  keys=("dtype", "weight_dtype", "matmul_precision", "mlp_activations", "remat_policy", "rope_type"),
  choices={
    "dtype": DTYPES,
    "weight_dtype": DTYPES,
    "matmul_precision": PRECISIONS,
    "remat_policy": REMAT_POLICIES,
    "rope_type": ROPE_TYPES,
  },
  check=check,
)

"""The mixture of experts' router (layers/moe.py): its score function, DeepSeek-V3's bias and groups, and the
weights of its outputs and of its balancing loss. What depends on the family (does its layer have a router at all,
a bias on the router's logits) is the family's to check (config_validate._check_moe)."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError
from MaxText.sections import Section

SCORE_FUNCS = ("", "softmax", "sigmoid")  # `routed_score_func`: "" is softmax


def check(values: Mapping) -> None:
  """Sigmoid routing's groups, the bias's updates, and the router's weights."""
  n, k = values["num_experts"], values["num_experts_per_tok"]
  groups, top_groups = values["n_routing_groups"], values["topk_routing_group"]
  if groups > 0 and values["routed_score_func"] != "sigmoid":
    raise ConfigError("n_routing_groups applies to sigmoid routing; set routed_score_func=sigmoid")
  if groups > 0 and (n % groups or not 1 <= top_groups <= groups or k > top_groups * (n // groups) or n // groups < 2):
    raise ConfigError(
      f"n_routing_groups={groups}, topk_routing_group={top_groups}: the groups must split num_experts={n} evenly into "
      f"groups of at least 2, with 1 <= topk_routing_group <= n_routing_groups holding num_experts_per_tok={k} experts"
    )
  sigmoid_bias = values["routed_bias"] and values["routed_score_func"] == "sigmoid"
  if values["routed_bias_update_rate"] < 0 or (values["routed_bias_update_rate"] > 0 and not sigmoid_bias):
    raise ConfigError(
      f"routed_bias_update_rate={values['routed_bias_update_rate']} must be >= 0, and updates the bias of "
      "routed_bias=true under sigmoid routing; set routed_bias=true and routed_score_func=sigmoid, or the rate to 0"
    )
  if values["routed_scaling_factor"] <= 0 or values["shared_experts"] < 0 or values["load_balance_loss_weight"] < 0:
    raise ConfigError(
      f"routed_scaling_factor={values['routed_scaling_factor']} must be positive, shared_experts="
      f"{values['shared_experts']} and load_balance_loss_weight={values['load_balance_loss_weight']} >= 0"
    )


SECTION = Section(
  name="router",
  keys=(
    "routed_score_func",
    "routed_bias",
    "routed_bias_update_rate",
    "routed_scaling_factor",
    "n_routing_groups",
    "topk_routing_group",
    "shared_experts",
    "load_balance_loss_weight",
  ),
  choices={"routed_score_func": SCORE_FUNCS},
  check=check,
)

"""LoRA's section (lora.py): the adapters' rank, scale and projections, and how a LoRA checkpoint is exported and
imported."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError, cut, shown
from MaxText.sections import Section

# hf_lora_export: how convert_to_hf_checkpoint.py writes a LoRA checkpoint: "merged" (the adapters folded into the
# kernels), "adapter" (a PEFT adapter folder), "base" (the model without its adapters).
HF_EXPORTS = ("merged", "adapter", "base")
# Our projection names -> the Hugging Face / PEFT module names of the Llama-like families (lora_target_modules takes
# either).
HF_NAMES = {
  "query": "q_proj",
  "key": "k_proj",
  "value": "v_proj",
  "out": "o_proj",
  "wi_0": "gate_proj",
  "wi_1": "up_proj",
  "wo": "down_proj",
}


def check(values: Mapping) -> None:
  """The LoRA keys, against the model's dimensions (emb_dim, head_dim, mlp_dim); raises ConfigError.
  lora_target_modules is checked with lora_rank=0 too: a wrong name there is a mistake the user meets once they turn
  LoRA on, so it is reported now."""
  rank, targets = values["lora_rank"], values["lora_target_modules"]
  if rank < 0:
    raise ConfigError(f"lora_rank={rank} is negative; give the adapters' rank (0 turns LoRA off)")
  unknown = [t for t in targets if t not in HF_NAMES and t not in HF_NAMES.values()]
  if unknown or not targets:
    raise ConfigError(
      f"lora_target_modules={shown(list(targets))}: {cut(unknown[0]) if unknown else 'empty'} is not a projection with "
      f"adapters; choose from {list(HF_NAMES)} (or PEFT's {list(HF_NAMES.values())})"
    )
  if rank == 0:
    if values["hf_lora_adapter_path"]:
      raise ConfigError("hf_lora_adapter_path is set but lora_rank=0; set lora_rank (and lora_alpha) to the adapter's")
    if values["hf_lora_export"] != "merged":
      raise ConfigError(
        f"hf_lora_export={values['hf_lora_export']} exports a LoRA checkpoint's adapters; give the run's lora_rank, "
        "lora_alpha and lora_target_modules"
      )
    return
  if values["lora_alpha"] <= 0:
    raise ConfigError(f"lora_alpha={values['lora_alpha']} must be > 0 (an adapter adds lora_alpha / lora_rank x A B)")
  smallest = min(values["emb_dim"], values["head_dim"], values["mlp_dim"])
  if rank >= smallest:
    raise ConfigError(
      f"lora_rank={rank} is not below the model's smallest projection width ({smallest}); a low-rank adapter "
      f"needs lora_rank < {smallest}"
    )


SECTION = Section(
  name="adapters",
  keys=("lora_rank", "lora_alpha", "lora_target_modules", "hf_lora_adapter_path", "hf_lora_export"),
  choices={"hf_lora_export": HF_EXPORTS},
  check=check,
)

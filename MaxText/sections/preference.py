"""Preference optimisation's section (objectives/dpo.py): DPO's loss (Rafailov et al. 2023, arXiv:2305.18290)."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError
from MaxText.sections import Section


def check(values: Mapping) -> None:
  """The loss's numbers, whichever objective the run trains (a value out of range is a mistake met once DPO is on)."""
  if values["dpo_beta"] <= 0 or not 0.0 <= values["dpo_label_smoothing"] <= 0.5:
    raise ConfigError(
      f"dpo_beta={values['dpo_beta']} must be > 0 and dpo_label_smoothing={values['dpo_label_smoothing']} in [0, 0.5]"
    )


SECTION = Section(name="preference", keys=("dpo_beta", "dpo_label_smoothing"), check=check)

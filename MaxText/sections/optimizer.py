"""The optimizer's section (optimizers.py): opt_type and its hyperparameters, the learning-rate schedule, and the
step counts it runs over."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError, shown
from MaxText.sections import Section
from MaxText.sections.layers import DTYPES

OPTIMIZERS = ("adamw", "adam_pax", "sgd", "adafactor", "muon")  # `opt_type` (optimizers.OPTIMIZERS builds each)
USES_MU_DTYPE = ("adamw", "muon")  # the opt_types that keep their first moment in mu_dtype
SCHEDULES = ("cosine", "wsd")  # `lr_schedule_type`
WSD_DECAY_STYLES = ("linear", "cosine")  # `wsd_decay_style`
MU_DTYPES = ("", *DTYPES)  # `mu_dtype`; "": the parameters' dtype


def _check_positive(values: Mapping, keys: tuple[str, ...]) -> None:
  for key in keys:
    if values[key] <= 0:
      raise ConfigError(f"{key}={shown(values[key])} must be positive")


def check_schedule(values: Mapping) -> None:
  """The step counts, the batch, and the learning-rate schedule's fractions."""
  _check_positive(values, ("log_period", "checkpoint_period", "gradient_accumulation_steps", "per_device_batch_size"))
  if values["steps"] == -1 and values["learning_rate_schedule_steps"] == -1:
    raise ConfigError("steps=-1 needs learning_rate_schedule_steps set; give one of them a positive value")
  if values["steps"] < -1 or values["steps"] == 0:
    raise ConfigError(f"steps={shown(values['steps'])} must be positive (or -1 to take learning_rate_schedule_steps)")
  # The step counts the compiled step sees: the optimizer's int32 step count against the schedule's boundaries (a
  # count past 2**31 - 1 overflows the jit's int32 arguments) and the accumulation scan's length.
  for key in ("steps", "learning_rate_schedule_steps", "gradient_accumulation_steps"):
    if values[key] >= 2**31:
      raise ConfigError(
        f"{key}={shown(values[key])} does not fit the int32 step counts of the compiled step; give at most {2**31 - 1}"
      )
  if not 0.0 <= values["warmup_steps_fraction"] <= 1.0:
    raise ConfigError(f"warmup_steps_fraction={values['warmup_steps_fraction']} must be in [0, 1]")
  if values["lr_schedule_type"] == "wsd":
    warmup, decay = values["warmup_steps_fraction"], values["wsd_decay_steps_fraction"]
    if not 0.0 <= decay <= 1.0 or warmup + decay > 1.0:
      raise ConfigError(
        f"wsd_decay_steps_fraction={decay} with warmup_steps_fraction={warmup}: the decay must be in [0, 1] and "
        "fit after the warmup (their sum at most 1)"
      )
  if not 0.0 <= values["learning_rate_final_fraction"] <= 1.0:
    raise ConfigError(f"learning_rate_final_fraction={values['learning_rate_final_fraction']} must be in [0, 1]")
  if values["learning_rate"] < 0:
    raise ConfigError(f"learning_rate={values['learning_rate']} is negative; give a peak learning rate >= 0")


def check_optimizer(values: Mapping) -> None:
  if values["mu_dtype"] and values["opt_type"] not in USES_MU_DTYPE:
    raise ConfigError(
      f"mu_dtype={values['mu_dtype']} is used by opt_type {' and '.join(USES_MU_DTYPE)} only; unset it "
      f"(mu_dtype='') for opt_type={values['opt_type']}"
    )
  if not 0.0 <= values["muon_beta"] < 1.0 or values["muon_consistent_rms"] < 0:
    raise ConfigError(
      f"muon_beta={values['muon_beta']} must be in [0, 1) and muon_consistent_rms={values['muon_consistent_rms']} >= 0"
    )


def check(values: Mapping) -> None:
  check_schedule(values)
  check_optimizer(values)


# The keys that set every step's learning rate (optimizers.learning_rate_schedule's; its warmup_steps is
# warmup_steps_fraction of learning_rate_schedule_steps, which is `steps` unless given).
SCHEDULE_KEYS = (
  "learning_rate",
  "learning_rate_schedule_steps",
  "warmup_steps_fraction",
  "learning_rate_final_fraction",
  "lr_schedule_type",
  "wsd_decay_steps_fraction",
  "wsd_decay_style",
)

SECTION = Section(
  name="optimizer",
  keys=(
    "opt_type",
    "mu_dtype",
    "adam_b1",
    "adam_b2",
    "adam_eps",
    "adam_eps_root",
    "adam_weight_decay",
    "muon_beta",
    "muon_weight_decay",
    "muon_consistent_rms",
    "gradient_clipping_threshold",
    "gradient_accumulation_steps",
    "steps",
    *SCHEDULE_KEYS,
  ),
  choices={
    "opt_type": OPTIMIZERS,
    "lr_schedule_type": SCHEDULES,
    "wsd_decay_style": WSD_DECAY_STYLES,
    "mu_dtype": MU_DTYPES,
  },
  check=check,
)

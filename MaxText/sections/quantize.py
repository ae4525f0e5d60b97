"""Quantization's section (layers/quantizations.py, through qwix; layers/kv_cache.py): what is quantized, to which
types, how the scales are calibrated, and the quantized parameters saved and loaded. What needs the devices
(fp8 on a GPU, the experts' kernel) is checked by quantizations.check_devices when the run has them."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError
from MaxText.sections import Section

TRAINING = ("int8", "fp8", "fp8_full")  # quantized training (quantizations.TRAINING gives their dtypes)
WEIGHT_ONLY = ("int8w", "int4w")  # weight-only quantization, for inference (quantizations.WEIGHT_ONLY)
QUANTIZATIONS = ("", *TRAINING, *WEIGHT_ONLY)  # `quantization`
# `quantization_targets`: the matmuls quantized (quantizations.TARGETS gives each its modules).
TARGETS = ("attention", "mlp", "moe", "head")
KV_QUANT_DTYPES = ("int8",)  # `kv_quant_dtype`: jax.numpy's dtypes of these names (quantizations.KV_QUANT_DTYPES)
KV_QUANT_AXES = ("dkv", "heads_and_dkv")  # `kv_quant_axis`
CALIBRATION_KEYS = tuple(f"{k}_quantization_calibration_method" for k in ("weight", "act", "bwd"))
# qwix's calibration methods (core/qarray.calibrate; minmax, asymmetric, is not offered): the counts of numbers
# each takes after its name.
_CALIBRATIONS = {"absmax": (0, 1), "rms": (1,), "fixed": (1, 2)}


def check(values: Mapping) -> None:
  """The quantization keys' own checks."""
  name = values["quantization"]
  if name and not values["use_qwix_quantization"]:
    raise ConfigError(
      f"use_qwix_quantization=false with quantization={name}: AQT, MaxText's older path, is not supported; "
      "set use_qwix_quantization=true"
    )
  unknown = [t for t in values["quantization_targets"] if t not in TARGETS]
  if unknown:
    raise ConfigError(f"quantization_targets contains {unknown[0]!r}; choose among {', '.join(TARGETS)}")
  if name and "head" in values["quantization_targets"] and values["logits_via_embedding"]:
    raise ConfigError(
      "quantization_targets contains head but logits_via_embedding=true: the tied head is the embedding's "
      "transpose, which is not quantized; drop head from quantization_targets"
    )
  shards = values["quantization_local_shard_count"]
  if shards == 0 or shards < -1:
    raise ConfigError(
      f"quantization_local_shard_count={shards}: give a positive number of tiles, or -1 for one per slice (num_slices)"
    )
  if name in TRAINING and shards > 0 and values["max_target_length"] % shards:
    # The weight gradient's contraction is over the tokens; qwix tiles its innermost axis, the sequence.
    raise ConfigError(
      f"quantization_local_shard_count={shards} does not divide max_target_length={values['max_target_length']} "
      "(weight gradients are quantized in tiles of the sequence); give a divisor of it"
    )
  for key in CALIBRATION_KEYS:
    _check_calibration(key, values[key])
  if name in WEIGHT_ONLY:
    _check_fused(values)
  group = values["quantization_group_size"]
  if group < 0:
    raise ConfigError(f"quantization_group_size={group} is negative; give 0 (one scale per channel) or a group size")
  if group and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"quantization_group_size={group} applies to weight-only quantization; set quantization to int8w or int4w"
    )
  if values["save_quantized_params_path"] and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"save_quantized_params_path={values['save_quantized_params_path']} writes weight-only quantized parameters; "
      "set quantization to int8w or int4w"
    )
  if values["checkpoint_is_quantized"] and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"checkpoint_is_quantized=true with quantization={name or '(none)'}: quantized parameters load only into "
      "their weight-only model; set quantization to the int8w or int4w they were saved with"
    )


def _check_calibration(key: str, method: str) -> None:
  """A calibration method qwix can run: absmax, absmax,<scale>, rms,<scale>, fixed,<max> or fixed,<min>,<max> with
  min <= 0 <= max, min < max (qwix's own error would come, as a traceback, from inside the first quantized matmul)."""
  name, *args = method.lower().split(",")
  try:
    numbers = [float(a) for a in args]
  except ValueError:
    numbers = None
  usage = "absmax, absmax,<scale>, rms,<scale>, fixed,<max> or fixed,<min>,<max>"
  if name not in _CALIBRATIONS or numbers is None or len(numbers) not in _CALIBRATIONS[name]:
    raise ConfigError(f"{key}={method!r} is not a calibration method; give {usage}")
  if name == "fixed":
    low, high = (-numbers[0], numbers[0]) if len(numbers) == 1 else numbers
    if not low <= 0 <= high or low >= high:
      raise ConfigError(f"{key}={method!r}: a fixed range must contain 0 and not be empty, e.g. fixed,-4,4")
  elif numbers and numbers[0] <= 0:
    raise ConfigError(f"{key}={method!r}: the scale must be positive, e.g. {name},1.0")


def _check_fused(values: Mapping) -> None:
  """Weight-only quantization finds a weight as the parameter of the module that multiplies by it; fused_qkv and
  fused_mlp multiply by their projections' kernels stacked in the parent module, where no parameter matches, so
  those kernels would stay float unseen."""
  targets = values["quantization_targets"]
  for key, reached in (("fused_qkv", "attention" in targets), ("fused_mlp", {"mlp", "moe"} & set(targets))):
    if values[key] and reached:
      raise ConfigError(
        f"{key}=true with quantization={values['quantization']}: weight-only quantization cannot reach the fused "
        f"matmul's stacked kernels (they would stay float); set {key}=false (the same parameters and numerics)"
      )


SECTION = Section(
  name="quantize",
  keys=(
    "quantization",
    "use_qwix_quantization",
    "quantization_targets",
    "quantization_local_shard_count",
    "quantization_group_size",
    *CALIBRATION_KEYS,
    "quantize_kvcache",
    "kv_quant_dtype",
    "kv_quant_axis",
    "save_quantized_params_path",
    "checkpoint_is_quantized",
  ),
  choices={"quantization": QUANTIZATIONS, "kv_quant_dtype": KV_QUANT_DTYPES, "kv_quant_axis": KV_QUANT_AXES},
  check=check,
)

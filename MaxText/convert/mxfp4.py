"""MXFP4 tensors (OCP Microscaling Formats v1.0, 2023): how gpt-oss's published checkpoints store expert weights,
and their exact dequantization, in NumPy.

A quantized linear weight W [*prefix, out, in] is stored as two tensors beside its name: `{name}_blocks` uint8
[*prefix, out, in / 32, 16], each byte two FP4 (E2M1) values of one 32-value block along `in`, the low nibble first;
and `{name}_scales` uint8 [*prefix, out, in / 32], the block's shared power of two as an E8M0 exponent (bias 127;
255 is NaN). Dequantized, a value is fp4 * 2 ** (scale - 127), then the last two axes are swapped, as transformers'
integrations/mxfp4.py (convert_moe_packed_tensors) gives it to GptOssExperts: gate_up_proj [experts, in, out].

Every result is exact in bfloat16: an E2M1 value has two significant bits, and 2 ** (scale - 127) for scale 0..254
lies in bfloat16's exponent range (2 ** -127 as a subnormal), so it is computed in float32 and rounded once, with
nothing to round; only products of 2 ** 128 and more (scales 253 and 254 with the largest values) overflow to
infinity, in bfloat16 as in float32, and so they do in transformers. The reserved scale 255 is NaN here, as the spec
says (transformers computes 2 ** 128 from it: infinity, or 0 for a zero value). Neither a NaN nor an infinity is a
weight: the importer refuses a tensor holding any (convert/streaming.py), unless hf_allow_non_finite_weights.
"""

import numpy as np

from MaxText.common_types import ConfigError

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1 by its 4 bits: sign, two exponent bits, one mantissa bit (OCP MX v1.0, sec. 5.3.3).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
SCALE_NAN = 255
DTYPE = "MXFP4"  # how HFTensors lists a pair's dtype (safetensors stores both parts as U8)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """blocks uint8 [*prefix, out, groups, 16] and scales uint8 [*prefix, out, groups] -> bfloat16
  [*prefix, groups * 32, out] (the weight with its last two axes swapped, see the module). One [out, in] matrix
  at a time goes through float32, so the float32 copy is one expert's, not the whole tensor's."""
  import ml_dtypes

  out = np.empty(dequantized_shape(blocks.shape), ml_dtypes.bfloat16)
  flat_out = out.reshape(-1, *out.shape[-2:])
  for i, (b, s) in enumerate(
    zip(blocks.reshape(-1, *blocks.shape[-3:]), scales.reshape(-1, *scales.shape[-2:]), strict=True)
  ):
    values = np.empty((*b.shape[:-1], 2 * b.shape[-1]), np.float32)  # [out, groups, 32]
    values[..., 0::2] = FP4_VALUES[b & 0x0F]
    values[..., 1::2] = FP4_VALUES[b >> 4]
    with np.errstate(over="ignore"):  # to infinity, as the module says
      values = np.ldexp(values, (s.astype(np.int32) - SCALE_BIAS)[..., None])
    values[s == SCALE_NAN] = np.nan
    flat_out[i] = values.reshape(b.shape[0], -1).T
  return out


def dequantized_shape(blocks: tuple[int, ...]) -> tuple[int, ...]:
  """The shape dequantize gives for blocks of shape `blocks`."""
  *prefix, out, groups, size = blocks
  return (*prefix, groups * size * 2, out)


def packed_pairs(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> dict[str, tuple[str, str]]:
  """The MXFP4 tensors among a checkpoint's (names -> shapes, and safetensors dtypes): {name: (its blocks, its
  scales)} for each uint8 `{name}_blocks` and `{name}_scales`; ConfigError, naming the tensor, for one without the
  other or a pair whose shapes do not fit."""
  packed = {}
  for stored, dtype in dtypes.items():
    if dtype != "U8" or not stored.endswith((BLOCKS, SCALES)):
      continue
    name = stored.removesuffix(BLOCKS).removesuffix(SCALES)
    blocks, scales = name + BLOCKS, name + SCALES
    missing = next((n for n in (blocks, scales) if dtypes.get(n) != "U8"), None)
    if missing is not None:
      raise ConfigError(
        f"hf_model_path: tensor {stored} is MXFP4 but {missing} is missing; the checkpoint is incomplete, re-download it"
      )
    if shapes[blocks][:-1] != shapes[scales] or len(shapes[scales]) < 2:
      raise ConfigError(
        f"hf_model_path: tensor {blocks} has shape {shapes[blocks]}, which does not fit {scales} of shape "
        f"{shapes[scales]} (MXFP4 blocks are the scales' shape + [16]); the checkpoint is damaged"
      )
    packed[name] = (blocks, scales)
  return packed

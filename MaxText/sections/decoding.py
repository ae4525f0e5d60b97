"""Decoding's section (inference/sampling.py): how the next token is sampled."""

from MaxText.sections import Section

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")  # `decode_sampling_strategy`

SECTION = Section(
  name="decoding",
  keys=(
    "decode_sampling_strategy",
    "decode_sampling_temperature",
    "decode_sampling_top_k",
    "decode_sampling_nucleus_p",
  ),
  choices={"decode_sampling_strategy": STRATEGIES},
)

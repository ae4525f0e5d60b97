"""Decoding's section (inference/): how the next token is sampled (sampling.py), and the engine's pages, prefill,
prefix cache and dispatches."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError
from MaxText.sections import Section

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")  # `decode_sampling_strategy`


def check(values: Mapping) -> None:
  """The engine's keys out of range, or that cannot go together."""
  for key in ("pagedattn_tokens_per_page", "prefill_chunk_size", "decode_steps_per_dispatch"):
    if values[key] < 1:
      raise ConfigError(f"{key}={values[key]} must be at least 1")
  if values["decode_batch_invariant"] and values["enable_prefix_caching"]:
    raise ConfigError(
      "decode_batch_invariant=true with enable_prefix_caching=true: a prompt whose first pages another request "
      "cached is prefilled by another path (attention to the cache), so its tokens would depend on that request; "
      "drop one of them"
    )
  if values["stream_interval_ms"] < 0:
    raise ConfigError(
      f"stream_interval_ms={values['stream_interval_ms']} is negative; give 0 (off) or a time in ms, e.g. 20"
    )
  if values["pagedattn_num_pages"] < 0:
    raise ConfigError(
      f"pagedattn_num_pages={values['pagedattn_num_pages']} is negative; give 0 (enough for every slot) or more"
    )


SECTION = Section(
  name="decoding",
  keys=(
    "decode_sampling_strategy",
    "decode_sampling_temperature",
    "decode_sampling_top_k",
    "decode_sampling_nucleus_p",
    "pagedattn_tokens_per_page",
    "pagedattn_num_pages",
    "use_chunked_prefill",
    "prefill_chunk_size",
    "enable_prefix_caching",
    "decode_batch_invariant",
    "decode_steps_per_dispatch",
    "stream_interval_ms",
  ),
  choices={"decode_sampling_strategy": STRATEGIES},
  check=check,
)

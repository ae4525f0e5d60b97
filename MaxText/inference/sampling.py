"""Choosing the next token from logits: greedy, weighted (temperature), top-k and nucleus sampling.

The engine samples every row with its own request's settings (`sample_rows`: temperature, top-k and top-p per
row, and a key per row from the request's seed and the token's index), so a row's sample depends only on its own
logits, its seed and its step, never on the other rows of its batch. `Sampling` is the config's strategy
(decode_sampling_*), which `request_settings` turns into those per-request values.
"""

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.common_types import Config, ConfigError
from MaxText.sections.decoding import STRATEGIES  # decode_sampling_strategy


@dataclasses.dataclass(frozen=True)
class Sampling:
  strategy: str = "greedy"
  temperature: float = 1.0
  top_k: int = 40
  nucleus_p: float = 0.9

  def __post_init__(self):
    # A config's strategy was checked by pyconfig; one built in code with another name would sample as "weighted".
    if self.strategy not in STRATEGIES:
      raise ValueError(f"strategy={self.strategy!r} is not one of {', '.join(STRATEGIES)}")

  @classmethod
  def from_config(cls, config: Config) -> "Sampling":
    sampling = cls(
      config.decode_sampling_strategy,
      config.decode_sampling_temperature,
      config.decode_sampling_top_k,
      config.decode_sampling_nucleus_p,
    )
    sampling.check(config.vocab_size)
    return sampling

  def check(self, vocab_size: int) -> None:
    """The values that depend on the strategy or the vocabulary (pyconfig checks the strategy is a STRATEGIES one)."""
    if self.temperature < 0:
      raise ConfigError(f"decode_sampling_temperature={self.temperature} is negative; give a value >= 0 (0 is greedy)")
    if self.strategy == "topk" and not 1 <= self.top_k <= vocab_size:
      raise ConfigError(f"decode_sampling_top_k={self.top_k} must be in [1, vocab_size={vocab_size}]")
    if self.strategy == "nucleus" and not 0.0 < self.nucleus_p <= 1.0:
      raise ConfigError(f"decode_sampling_nucleus_p={self.nucleus_p} must be in (0, 1]")

  def request_settings(self) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of one request: 0 temperature is greedy, top_k 0 and top_p 1 are off."""
    if self.strategy == "greedy":
      return 0.0, 0, 1.0
    top_k = self.top_k if self.strategy == "topk" else 0
    top_p = self.nucleus_p if self.strategy == "nucleus" else 1.0
    return self.temperature, top_k, top_p


def _filtered(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """logits [batch, vocab] with every token outside each row's top-k (top_k > 0) and outside its nucleus (the
  smallest set of most likely tokens whose mass reaches top_p) set to -inf. A token is kept while the mass of
  the tokens ranked above it is below top_p, so the most likely token always is; ties at the cut are kept."""
  ranked = -jnp.sort(-logits, axis=-1)
  vocab = logits.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  probs = jax.nn.softmax(ranked, axis=-1)
  in_nucleus = ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]) | (top_p[:, None] >= 1.0)
  keep = jnp.minimum(k, jnp.maximum(jnp.sum(in_nucleus, axis=-1), 1))
  cut = jnp.take_along_axis(ranked, (keep - 1)[:, None], axis=-1)
  return jnp.where(logits >= cut, logits, -jnp.inf)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
  """logits [batch, vocab] -> tokens [batch] int32, each row with its own key (typed, [batch]) and settings
  ([batch] each; temperature 0 is greedy). Sorting the vocabulary (top-k, top-p) and drawing are skipped when no
  row needs them."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(logits):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
    scaled = jax.lax.cond(needs_filter, _filtered, lambda x, *_: x, scaled, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, logits)

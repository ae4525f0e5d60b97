"""Choosing the next token from logits: greedy, weighted (temperature), top-k and nucleus sampling.

Every strategy works on one row's logits [vocab] and is vmapped over the batch with the same key for every
row, so a row's sample depends only on its own logits, the seed and the step, never on the other rows of
its batch.
"""

import dataclasses

import jax
import jax.numpy as jnp

from MaxText.common_types import Config, ConfigError

STRATEGIES = ("greedy", "weighted", "nucleus", "topk")


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


def _row(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
  """One row's next token: logits [vocab] -> int32 scalar."""
  logits = logits.astype(jnp.float32)
  if s.strategy == "greedy" or s.temperature == 0.0:
    return jnp.argmax(logits).astype(jnp.int32)
  logits = logits / s.temperature
  if s.strategy == "topk":
    top, index = jax.lax.top_k(logits, s.top_k)
    return index[jax.random.categorical(key, top)].astype(jnp.int32)
  if s.strategy == "nucleus":
    # The smallest set of most likely tokens whose mass reaches p: a token is kept while the mass of the
    # tokens ranked above it is still below p (so the most likely token always is).
    order = jnp.argsort(-logits)
    ranked = logits[order]
    probs = jax.nn.softmax(ranked)
    mass_above = jnp.cumsum(probs) - probs
    ranked = jnp.where(mass_above < s.nucleus_p, ranked, -jnp.inf)
    return order[jax.random.categorical(key, ranked)].astype(jnp.int32)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """logits [batch, vocab] -> next tokens [batch] int32; `key` is shared by the rows (see module doc)."""
  return jax.vmap(lambda row: _row(row, key, sampling))(logits)

"""The KV cache's memory, on the host: each slot's page table, its reservation, and the prefix cache.

pages.py hands out page numbers (free, held, cached); this module decides who gets them. A request is admitted only
when the pages its prompt and max_tokens may need, less those the prefix cache already holds for its prompt, are
available beyond what the running requests have reserved; so a running request never runs out of pages and none is
ever preempted. Its pages are then taken as its tokens need them (`grow`), its prompt's full pages are offered to
the prefix cache once prefilled (`cache_prompt`), and all are released when it ends (`free`).

The page table (`table`, [slots, pages per row]) is what the model runner's programs read: row i's pages in order.
"""

import math

import numpy as np

from MaxText.inference import pages as pages_lib

MIN_READ_TOKENS = 64  # the fewest cache positions a generate call reads (see KVCacheManager.pages_read)


def power_of_two(n: int, limit: int) -> int:
  """The smallest power of two >= n, at most `limit`."""
  size = 1
  while size < n:
    size *= 2
  return min(size, limit)


class KVCacheManager:
  def __init__(  # noqa: PLR0913 (the cache's shape, then its two policies)
    self,
    num_slots: int,
    num_pages: int,
    page_size: int,
    max_length: int,
    prefix_caching: bool = False,
    batch_invariant: bool = False,
  ):
    self.page_size, self.num_pages = page_size, num_pages
    self.pages_per_row = math.ceil(max_length / page_size)
    self.prefix_caching, self.batch_invariant = prefix_caching, batch_invariant
    self.pages = pages_lib.Pages(num_pages, page_size)
    self.table = np.zeros((num_slots, self.pages_per_row), np.int32)
    self._held: list[list[int]] = [[] for _ in range(num_slots)]  # each slot's pages, in order
    self._digests: list[list[bytes]] = [[] for _ in range(num_slots)]  # its prompt's full pages' digests
    self._reserve = [0] * num_slots  # pages it may take in all

  def reset(self) -> None:
    """Forgets every cached prefix (new parameters: their keys and values came from the old ones). Slots are idle."""
    assert not any(self._held), "reset() with pages held"
    self.pages = pages_lib.Pages(self.num_pages, self.page_size)

  def pages_needed(self, tokens: int) -> int:
    return math.ceil(tokens / self.page_size)

  def pages_read(self, tokens: int) -> int:
    """Pages a generate call reads to reach `tokens` positions: a power of two of them covering at least
    MIN_READ_TOKENS (fewer shapes to compile; short caches are read whole), at most a row's; with
    decode_batch_invariant always a row's (the attention's reductions then never depend on the longest neighbour)."""
    if self.batch_invariant:
      return self.pages_per_row
    floor = self.pages_needed(MIN_READ_TOKENS)
    return power_of_two(max(self.pages_needed(tokens), floor), self.pages_per_row)

  def reserved(self) -> int:
    """Pages the busy slots may still take (each up to its prompt and max_tokens)."""
    return sum(reserve - len(held) for reserve, held in zip(self._reserve, self._held, strict=True))

  def admit(self, slot: int, prompt, max_tokens: int, echo: bool = False) -> int | None:
    """Reserves the pages of a request for the idle `slot` and gives it those for its prompt. Returns how many of
    its prompt's tokens the prefix cache already holds (they need no prefill), or None when its pages are not
    available yet (it must wait; nothing is taken)."""
    # Cached pages for the prompt's full pages but its last token (whose logits the prefill must compute); not with
    # echo, which needs every prompt token's logprobs.
    digests = pages_lib.prefix_digests(prompt, self.page_size)
    shared = []
    if self.prefix_caching and not echo:
      shared = self.pages.match(digests[: (len(prompt) - 1) // self.page_size])
    reserve = self.pages_needed(len(prompt) + max_tokens - 1)
    if self.pages.available() - self.reserved() < reserve - len(shared):
      self.pages.release(shared)
      return None
    self._held[slot], self._digests[slot], self._reserve[slot] = list(shared), digests, reserve
    self.grow(slot, len(prompt))
    return len(shared) * self.page_size

  def grow(self, slot: int, tokens: int) -> None:
    """Gives the slot pages for its first `tokens` tokens (at most its reservation)."""
    held = self._held[slot]
    while len(held) < min(self.pages_needed(tokens), self._reserve[slot]):
      held.append(self.pages.take())
    self.table[slot, : len(held)] = held

  def cache_prompt(self, slot: int) -> None:
    """The slot's prompt is prefilled: its full pages may be shared by later prompts with the same prefix."""
    for page, digest in zip(self._held[slot], self._digests[slot], strict=False):
      self.pages.cache(page, digest)

  def free(self, slot: int) -> None:
    self.pages.release(self._held[slot])
    self._held[slot], self._digests[slot], self._reserve[slot] = [], [], 0
    self.table[slot] = 0

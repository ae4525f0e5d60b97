"""The KV cache manager (inference/kv_cache_manager.py): reservations, the page table, the prefix cache, the pages a
generate call reads; counted by hand (pages of 4 tokens)."""

import numpy as np

from MaxText.inference.kv_cache_manager import KVCacheManager

PAGE = 4


def _manager(num_pages=8, slots=2, max_length=32, **policies) -> KVCacheManager:
  return KVCacheManager(slots, num_pages, PAGE, max_length, **policies)


def test_a_request_reserves_its_prompt_and_max_tokens_and_takes_pages_as_it_grows():
  """A 6-token prompt with max_tokens=7 may reach 6 + 7 - 1 = 12 cached tokens: 3 pages reserved, 2 taken for the
  prompt; growing past the reservation takes no more."""
  kv = _manager()
  assert kv.admit(0, list(range(6)), 7) == 0
  assert (kv.pages.held(), kv.reserved()) == (2, 1)
  assert list(kv.table[0, :2]) == [0, 1] and not kv.table[0, 2:].any()
  kv.grow(0, 9)
  assert (kv.pages.held(), kv.reserved()) == (3, 0) and list(kv.table[0, :3]) == [0, 1, 2]
  kv.grow(0, 30)  # past its max_tokens: never beyond its reservation
  assert kv.pages.held() == 3
  kv.free(0)
  assert kv.pages.held() == 0 and kv.pages.available() == 8 and not kv.table.any()


def test_a_request_waits_while_the_reservations_leave_too_few_pages():
  """8 pages: the first request reserves 6 (holding 1), so a second one needing 3 waits, taking nothing, until the
  first ends; the pages the first has not taken yet count as taken."""
  kv = _manager()
  assert kv.admit(0, [1, 2], 22) == 0  # 2 + 22 - 1 = 23 tokens: 6 pages
  assert kv.admit(1, list(range(9)), 4) is None  # 9 + 4 - 1 = 12 tokens: 3 pages, 2 left
  assert kv.pages.held() == 1 and not kv.table[1].any()
  kv.free(0)
  assert kv.admit(1, list(range(9)), 4) == 0 and kv.pages.held() == 3


def test_a_prompt_shares_the_cached_full_pages_of_an_equal_prefix():
  """A 10-token prompt caches its 2 full pages once prefilled; a later prompt equal on its first 9 tokens takes both
  (8 tokens need no prefill), one equal on 5 takes the first only; echo (every prompt logprob) takes none, and a
  prompt whose last token ends a page leaves that page to its prefill (its logits are computed there)."""
  kv = _manager(num_pages=16, prefix_caching=True)
  first = list(range(10))
  assert kv.admit(0, first, 2) == 0
  kv.cache_prompt(0)
  kept = list(kv.table[0, :2])
  kv.free(0)
  assert kv.admit(1, [*first[:9], 99], 2) == 8 and list(kv.table[1, :2]) == kept
  assert kv.admit(0, [*first[:5], 98, 97], 2) == 4 and kv.table[0, 0] == kept[0]
  kv.free(0)
  assert kv.admit(0, first, 2, echo=True) == 0
  kv.free(0)
  assert kv.admit(0, first[:8], 2) == 4  # 8 tokens: the second page holds its last token


def test_without_prefix_caching_nothing_is_shared():
  kv = _manager()
  assert kv.admit(0, list(range(10)), 2) == 0
  kv.cache_prompt(0)
  kv.free(0)
  assert kv.admit(0, list(range(10)), 2) == 0


def test_a_generate_call_reads_a_power_of_two_of_pages_from_64_tokens_up_to_a_row():
  """Pages of 4 and rows of 256 tokens (64 pages): at least 16 pages (64 tokens), then powers of two; with
  decode_batch_invariant always the whole row."""
  kv = _manager(num_pages=64, max_length=256)
  reads = [kv.pages_read(t) for t in (1, 64, 65, 128, 129, 256, 1000)]
  assert reads == [16, 16, 32, 32, 64, 64, 64]
  invariant = _manager(num_pages=64, max_length=256, batch_invariant=True)
  assert {invariant.pages_read(t) for t in (1, 100, 256)} == {64}


def test_reset_forgets_the_cached_prefixes():
  kv = _manager(prefix_caching=True)
  kv.admit(0, list(range(10)), 2)
  kv.cache_prompt(0)
  kv.free(0)
  kv.reset()
  assert kv.admit(0, list(range(10)), 2) == 0 and np.array_equal(kv.table[0, :3], [0, 1, 2])

"""The pages of the paged KV cache, on the host: which are free, who holds each, and the prefix cache.

The device holds the pool ([layers, pages, page_size, ...], layers/kv_cache.py); this module only hands out page
numbers. A page is free, held (a reference count of the requests whose page tables name it), or cached: a full
page of some prompt's tokens that no request holds any more but that a later request with the same prefix may take
again (enable_prefix_caching). Cached pages are given out for new tokens only when no free page is left, least
recently used first.

A full page of prompt tokens is known by a digest of every token up to its end (the page's own tokens and the
digest of the page before), so a page is shared only by prompts equal up to and including it: what it holds (keys
after RoPE, at their positions) is then the same for both.
"""

import collections
import hashlib

import numpy as np


def prefix_digests(tokens, page_size: int) -> list[bytes]:
  """The digest of each full page of `tokens`: page i's covers tokens [0, (i + 1) * page_size)."""
  digests, previous = [], b""
  for end in range(page_size, len(tokens) + 1, page_size):
    chunk = np.asarray(tokens[end - page_size : end], np.int64).tobytes()
    previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
    digests.append(previous)
  return digests


class Pages:
  def __init__(self, num_pages: int, page_size: int):
    self.page_size = page_size
    self.num_pages = num_pages
    self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
    self._refs = np.zeros(num_pages, np.int64)
    self._by_digest: dict[bytes, int] = {}
    self._digest_of: dict[int, bytes] = {}
    self._unused = collections.OrderedDict()  # cached pages no request holds, least recently used first

  def available(self) -> int:
    """Pages that can be handed out now (free, or cached and held by no request)."""
    return len(self._free) + len(self._unused)

  def held(self) -> int:
    return int(np.count_nonzero(self._refs))

  def take(self) -> int:
    """A page for new tokens, held once: a free page, else the least recently used cached one (forgotten)."""
    if self._free:
      page = self._free.pop()
    else:
      page, _ = self._unused.popitem(last=False)
      del self._by_digest[self._digest_of.pop(page)]
    self._refs[page] = 1
    return page

  def match(self, digests: list[bytes]) -> list[int]:
    """The cached pages of the longest prefix of `digests`, each now held once more."""
    pages = []
    for digest in digests:
      page = self._by_digest.get(digest)
      if page is None:
        break
      self._unused.pop(page, None)
      self._refs[page] += 1
      pages.append(page)
    return pages

  def cache(self, page: int, digest: bytes) -> None:
    """Records that held `page` is the full page with `digest`, for later requests to share."""
    if digest not in self._by_digest and page not in self._digest_of:
      self._by_digest[digest] = page
      self._digest_of[page] = digest

  def release(self, pages) -> None:
    """Drops one hold on each page; a page no request holds becomes free, or stays cached when it has a digest."""
    for page in pages:
      self._refs[page] -= 1
      if self._refs[page] == 0:
        if page in self._digest_of:
          self._unused[page] = None
        else:
          self._free.append(page)

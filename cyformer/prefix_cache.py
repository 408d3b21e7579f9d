"""Keys and values of recent prompts, reused by requests that start the same way.

A position's key and value depend only on the tokens up to it, so a prompt
that shares its first n tokens with an earlier one (a system prompt, the
earlier turns of a chat) can copy those n rows of every layer's cache and
prefill only the rest.  Entries hold the filled rows of a KVCache
(k [L, G, D, n], v [L, G, n, D]) keyed by their token ids, in a least
recently used order, within a byte budget.

Only rows computed by a prefill through the GEMM path are stored (see
CythonBackend.exact_chunk): those are bitwise the rows any longer prefill
computes, so a request that reuses them gets the logits it would get alone.
"""

import threading
from collections import OrderedDict

import numpy as np

from .kv_cache import KVCache

DEFAULT_MB = 256  # GPT-2 small: 72 KB per position, about 3,600 positions


class PrefixCache:
    """A bounded LRU of prompt caches.

    max_bytes: the most the stored rows may take (0 stores nothing).
    Thread-safe; the engine's scheduler is its only writer.
    """

    def __init__(self, max_mb=DEFAULT_MB):
        if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not max_mb >= 0:
            raise ValueError(f"prefix cache size must be a number of MB >= 0, got {max_mb!r}")
        self.max_bytes = int(max_mb * 2**20)
        self._entries = OrderedDict()  # tuple of ids -> (ids array, k, v); oldest first
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = 0          # lookups that reused at least one position
        self.misses = 0
        self.hit_tokens = 0    # positions not prefilled thanks to the cache
        self.evictions = 0

    def __len__(self):
        return len(self._entries)

    def lookup(self, ids, kv: KVCache, keep=1):
        """Copy the longest cached prefix of ``ids`` (at most len(ids) - keep
        positions) into the empty cache ``kv``; returns the positions copied."""
        ids = np.asarray(ids, dtype=np.int64)
        limit = min(len(ids) - keep, kv.limit)
        best, best_n = None, 0
        with self._lock:
            if limit > 0:
                for key, entry in self._entries.items():
                    n = _common_prefix(entry[0], ids, limit)
                    if n > best_n:
                        best, best_n = key, n
            if best is None:
                self.misses += 1
                return 0
            self._entries.move_to_end(best)
            _, k, v = self._entries[best]
            self.hits += 1
            self.hit_tokens += best_n
        kv.reserve(best_n)
        kv.k[:, :, :, :best_n] = k[:, :, :, :best_n]
        kv.v[:, :, :best_n] = v[:, :, :best_n]
        kv.length = best_n
        return best_n

    def store(self, ids, kv: KVCache):
        """Keep a copy of the first len(ids) rows of ``kv`` (filled for ``ids``)."""
        ids = np.array(ids, dtype=np.int64)
        n = len(ids)
        if n == 0 or n > kv.length:
            raise ValueError(f"PrefixCache.store: {n} ids but the cache holds {kv.length} positions")
        L, G, D = kv.k.shape[0], kv.k.shape[1], kv.k.shape[2]
        size = 2 * L * G * D * n * 4
        if size > self.max_bytes:
            return False
        key = tuple(ids.tolist())
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            # an entry that is a prefix of this one answers no lookup this one cannot
            for other in [o for o, e in self._entries.items()
                          if len(e[0]) <= n and _common_prefix(e[0], ids, len(e[0])) == len(e[0])]:
                self._drop(other)
            while self.nbytes + size > self.max_bytes:
                self._drop(next(iter(self._entries)))
                self.evictions += 1
        k = np.ascontiguousarray(kv.k[:, :, :, :n])
        v = np.ascontiguousarray(kv.v[:, :, :n])
        with self._lock:
            while self.nbytes + size > self.max_bytes:  # another store won the race
                self._drop(next(iter(self._entries)))
                self.evictions += 1
            self._entries[key] = (ids, k, v)
            self.nbytes += size
        return True

    def _drop(self, key):
        ids, k, v = self._entries.pop(key)
        self.nbytes -= k.nbytes + v.nbytes

    def clear(self):
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def stats(self):
        """Counters for metrics: entries, bytes, max_bytes, hits, misses, hit_tokens, evictions."""
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens,
                    "evictions": self.evictions}


def _common_prefix(a, b, limit):
    """How many leading ids a and b share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n

"""Rotary position embeddings: the angle tables every backend reads.

A rotary model adds no position vector to the stream.  Instead each query and
key head vector is split into D/2 pairs (dimension i with i + D/2, Hugging
Face's "rotate half" layout) and pair i at position p is turned by the angle
p * inv_freq[i].  A query at p and a key at p' then score by their vectors'
directions and p - p' alone.  inv_freq[i] = theta^(-2i/D): the first pairs turn
fast and tell neighbours apart, the last turn slowly and carry long ranges.

The tables are computed in float32 the way transformers computes them
(inv_freq in float32, angle = float32(p) * inv_freq rounded to float32, then
cos and sin), so cyformer's rotations agree with transformers' to the last
bit or two.  A row depends only on its position, so the tables are built up
to the positions used so far (``Tables``, doubling as caches grow), never for
the whole configured context up front: a config may claim 16 M positions.
"""

import math
import threading

import numpy as np


def inv_freq(cfg):
    """[D/2] float32 angular frequencies, after the config's rope scaling."""
    D = cfg.d_head
    exponent = np.arange(0, D, 2, dtype=np.int64).astype(np.float32) / np.float32(D)
    base = np.float32(cfg.rope_theta)
    freq = (np.float32(1.0) / (base ** exponent)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return freq
    if s.kind == "linear":
        return (freq / np.float32(s.factor)).astype(np.float32)
    # llama3: long wavelengths slowed by `factor`, short ones kept, blended between
    wavelen = np.float32(2 * math.pi) / freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_wavelen, freq / np.float32(s.factor), freq).astype(np.float32)
    smooth = ((np.float32(s.original_max_position_embeddings) / wavelen - np.float32(s.low_freq_factor))
              / np.float32(s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    blended = ((1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rows(freq, start, stop):
    """(cos, sin) of positions start .. stop-1, each [stop - start, D/2]
    float32 and read-only, from inv_freq(cfg): row p turns pair i by p * freq[i]."""
    angles = np.arange(start, stop, dtype=np.float32)[:, None] * freq[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def tables(cfg):
    """(cos, sin), each [P, D/2] float32 and read-only, for every position of
    the context (tests and small models; backends use Tables)."""
    return rows(inv_freq(cfg), 0, cfg.n_positions)


class Tables:
    """The tables of the first ``rows`` positions, grown on demand.

    ``ensure(n)`` makes them cover positions 0 .. n-1 (at least doubling,
    at most n_positions) and says whether they grew; ``cos`` and ``sin``
    are then [rows, D/2].  Earlier tables are kept alive, because a kernel
    in another thread may still be reading them through a raw pointer.
    """

    FIRST = 256  # rows built at load: a short prompt never grows them

    def __init__(self, cfg):
        self.freq = inv_freq(cfg)
        self.limit = cfg.n_positions
        self._lock = threading.Lock()
        self._old = []
        self.cos, self.sin = rows(self.freq, 0, min(self.FIRST, self.limit))

    @property
    def rows(self):
        return len(self.cos)

    def ensure(self, n):
        if n <= self.rows:
            return False
        with self._lock:
            if n <= self.rows:
                return False
            want = min(self.limit, max(n, 2 * self.rows))
            cos, sin = rows(self.freq, 0, want)  # rebuilt whole: bitwise the rows a full table has
            self._old.append((self.cos, self.sin))
            self.cos, self.sin = cos, sin
            return True

    def __iter__(self):  # (cos, sin), as tables() returns them
        return iter((self.cos, self.sin))


def rotate(x, cos, sin):
    """x [..., T, D] turned by cos, sin [T, D/2] (NumPy, for the reference backends)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

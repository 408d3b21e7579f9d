"""Rotary position embeddings: the angle tables every backend reads.

A rotary model adds no position vector to the stream.  Instead each query and
key head vector is split into D/2 pairs (dimension i with i + D/2, Hugging
Face's "rotate half" layout) and pair i at position p is turned by the angle
p * inv_freq[i].  A query at p and a key at p' then score by their vectors'
directions and p - p' alone.  inv_freq[i] = theta^(-2i/D): the first pairs turn
fast and tell neighbours apart, the last turn slowly and carry long ranges.

The tables are computed once, in float32 the way transformers computes them
(inv_freq in float32, angle = float32(p) * inv_freq rounded to float32, then
cos and sin), so cyformer's rotations agree with transformers' to the last
bit or two.
"""

import math

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


def tables(cfg):
    """(cos, sin), each [P, D/2] float32 and read-only; position p's row turns
    pair i by p * inv_freq[i]."""
    angles = np.arange(cfg.n_positions, dtype=np.float32)[:, None] * inv_freq(cfg)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def rotate(x, cos, sin):
    """x [..., T, D] turned by cos, sin [T, D/2] (NumPy, for the reference backends)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

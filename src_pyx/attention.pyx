"""Causal multi-head self-attention over a per-sequence key/value cache.

This is the only module where positions mix: every other kernel treats each
position (row) on its own.

Dimension letters: T new positions, P = past positions already cached,
H query heads, G key/value heads (G = H for GPT-2; G < H is grouped-query
attention, where each run of H / G query heads shares one key/value head),
D = d_head, cap = cache capacity (positions).  A row of qkv holds the H
query heads, then the G key heads, then the G value heads: (H + 2G) D floats.

For each query head h (reading key/value head g = h / (H / G)) and new
position t (absolute position p = P + t):
    scores[j] = q_p . k_j / sqrt(D)     for j <= p (future positions masked)
    pattern   = softmax(scores)
    z_p       = sum_j pattern[j] v_j
Work is split over (head, position) pairs, each computed start to finish by
one thread, so the summation order never depends on the thread count.  Keys
are cached transposed ([G, D, cap]) so one query's scores vectorise over key
positions; values stay [G, cap, D] so the weighted sum vectorises over D.

Rotary position embeddings (Llama) turn each query and key head vector by
angles that depend on its position, before the keys are cached; ``rope``
does that in place on qkv rows.
"""

from cython.parallel cimport parallel, prange, threadid
from libc.math cimport sqrt, INFINITY

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport softmax_row
from .linalg cimport scratch_floats
from .simd cimport CYF_MR, CYF_NR, cyf_gemv_strip, cyf_gemm_tile

from cyformer import _checks

cnp.import_array()


cdef Py_ssize_t attention_scratch_size(Py_ssize_t cap, Py_ssize_t d_head) noexcept nogil:
    # CYF_MR score rows (+ a strip of slack), one output tile, one z row
    return CYF_MR * (cap + KEY_BLOCK) + CYF_MR * CYF_NR + d_head + KEY_BLOCK


cdef Py_ssize_t attend_one_scratch_size(Py_ssize_t cap, Py_ssize_t d_head) noexcept nogil:
    # one score row and one z row, each with a strip of slack
    return cap + KEY_BLOCK + d_head + KEY_BLOCK


cdef void rope_head(float* x, Py_ssize_t D, const float* cos, const float* sin) noexcept nogil:
    # Hugging Face's rotate-half layout: dimension i pairs with i + D/2, and
    # the pair turns by the angle whose cos/sin are at index i.
    cdef Py_ssize_t i, half = D // 2
    cdef float a, b
    for i in range(half):
        a = x[i]
        b = x[i + half]
        x[i] = a * cos[i] - b * sin[i]
        x[i + half] = b * cos[i] + a * sin[i]


cdef void rope(float* qkv, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
               Py_ssize_t past, const float* cos, const float* sin, int nthreads) noexcept nogil:
    cdef Py_ssize_t ld = (H + 2 * G) * D, half = D // 2, i, t, h
    for i in prange(T * (H + G), num_threads=nthreads, schedule="static"):
        t = i // (H + G)
        h = i % (H + G)  # query heads, then key heads: contiguous in the row
        rope_head(qkv + t * ld + h * D, D, cos + (past + t) * half, sin + (past + t) * half)


cdef void append_kv_head(const float* qkv, float* k_cache, float* v_cache, Py_ssize_t past,
                         Py_ssize_t T, Py_ssize_t g, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
                         Py_ssize_t cap) noexcept nogil:
    cdef Py_ssize_t ld = (H + 2 * G) * D, t, d
    cdef const float* row
    for t in range(T):
        row = qkv + t * ld + (H + g) * D
        for d in range(D):
            k_cache[(g * D + d) * cap + past + t] = row[d]
            v_cache[(g * cap + past + t) * D + d] = row[G * D + d]


cdef void _append_kv(const float* qkv, float* k_cache, float* v_cache, Py_ssize_t past,
                     Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D, Py_ssize_t cap,
                     int nthreads) noexcept nogil:
    cdef Py_ssize_t g
    for g in prange(G, num_threads=nthreads, schedule="static"):
        append_kv_head(qkv, k_cache, v_cache, past, T, g, H, G, D, cap)


cdef inline void _weights(float* s, Py_ssize_t L, Py_ssize_t S, float inv_sqrt_d,
                          float* scores, float* pattern, Py_ssize_t at) noexcept nogil:
    # s[0:L] raw dot products of one query -> attention weights, in place;
    # scores/pattern (when asked for) get the row at offset `at`, S wide.
    cdef Py_ssize_t j
    for j in range(L):
        s[j] = s[j] * inv_sqrt_d
    if scores != NULL:
        for j in range(S):
            scores[at + j] = s[j] if j < L else -INFINITY
    softmax_row(s, L)
    if pattern != NULL:
        for j in range(S):
            pattern[at + j] = s[j] if j < L else 0.0


cdef void attend_one(float* z, const float* q, const float* kT, const float* vh,
                     Py_ssize_t L, Py_ssize_t D, Py_ssize_t cap, float* scratch,
                     Py_ssize_t S, float* scores, float* pattern, Py_ssize_t at) noexcept nogil:
    # One query of one head against its first L keys: matrix-vector strips.
    cdef Py_ssize_t j, jb, d, db
    cdef float inv_sqrt_d = <float>(1.0 / sqrt(<double>D))
    cdef float* s = scratch
    cdef float* zacc = scratch + cap + KEY_BLOCK
    # scores: s[j] = q . k_j, 64 key positions at a time
    for jb in range((L + KEY_BLOCK - 1) // KEY_BLOCK):
        j = jb * KEY_BLOCK
        cyf_gemv_strip(q, kT + j, cap, D, KEY_BLOCK if L - j > KEY_BLOCK else L - j, s + j)
    _weights(s, L, S, inv_sqrt_d, scores, pattern, at)
    # z = sum_j pattern[j] v_j, d_head columns at a time
    for db in range((D + KEY_BLOCK - 1) // KEY_BLOCK):
        d = db * KEY_BLOCK
        cyf_gemv_strip(s, vh + d, D, L, KEY_BLOCK if D - d > KEY_BLOCK else D - d, zacc + d)
    for d in range(D):
        z[d] = zacc[d]


cdef void _attend_rows(float* z, const float* qkv, const float* k_cache, const float* v_cache,
                       Py_ssize_t past, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
                       Py_ssize_t cap, float* scores, float* pattern,
                       float* scratch, int nthreads) noexcept nogil:
    # One query at a time (decode, short prompts).
    cdef Py_ssize_t ld = (H + 2 * G) * D, S = past + T  # S: keys visible to the last query
    cdef Py_ssize_t i, h, t, g
    cdef float* s
    with parallel(num_threads=nthreads):
        s = scratch + threadid() * attention_scratch_size(cap, D)
        # Later positions see more keys; dynamic scheduling balances the
        # triangle (and the few heads of a decode step).
        for i in prange(H * T, schedule="dynamic", chunksize=1):
            h = i // T
            t = i % T
            g = h // (H // G)
            attend_one(z + t * H * D + h * D, qkv + t * ld + h * D, k_cache + g * D * cap,
                       v_cache + g * cap * D, past + t + 1, D, cap, s,
                       S, scores, pattern, (h * T + t) * S)


cdef void _attend_tiles(float* z, const float* qkv, const float* k_cache, const float* v_cache,
                        Py_ssize_t past, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
                        Py_ssize_t cap, float* scores, float* pattern,
                        float* scratch, int nthreads) noexcept nogil:
    # CYF_MR queries of one head at a time (prefill): the scores of the tile
    # are a small matrix product Q_tile @ K^T and the outputs P_tile @ V, both
    # through the CYF_MR x CYF_NR register tile, so every key and value loaded
    # serves CYF_MR queries.  Each score is still one d-ordered dot product and each output
    # one j-ordered sum (masked weights are exact zeros), so the results do
    # not depend on the tiling or the thread count.
    cdef Py_ssize_t ld = (H + 2 * G) * D, C = H * D, S = past + T
    cdef Py_ssize_t ntiles = (T + CYF_MR - 1) // CYF_MR
    cdef Py_ssize_t i, h, tq, t0, t, r, L, Lmax, j, jb, d, db, dw, nstr, g
    cdef int rows
    cdef float* sbuf
    cdef float* s
    cdef float* tile
    cdef float* zrow
    cdef const float* q
    cdef const float* kT
    cdef const float* vh
    cdef float inv_sqrt_d = <float>(1.0 / sqrt(<double>D))
    cdef Py_ssize_t lds = cap + KEY_BLOCK  # score row stride
    with parallel(num_threads=nthreads):
        sbuf = scratch + threadid() * attention_scratch_size(cap, D)
        tile = sbuf + CYF_MR * lds
        zrow = tile + CYF_MR * CYF_NR
        for i in prange(H * ntiles, schedule="dynamic", chunksize=1):
            h = i // ntiles
            tq = i % ntiles
            g = h // (H // G)
            t0 = tq * CYF_MR
            rows = <int>(T - t0 if T - t0 < CYF_MR else CYF_MR)
            Lmax = past + t0 + rows  # keys visible to the tile's last query
            q = qkv + t0 * ld + h * D
            kT = k_cache + g * D * cap
            vh = v_cache + g * cap * D
            # scores of every query in the tile against keys 0 .. Lmax-1,
            # straight into the score rows.  A last partial strip also goes
            # through the tile when the cache row has CYF_NR more columns to read
            # (KVCache pads them); its scores past Lmax are never used.
            nstr = Lmax // CYF_NR
            if Lmax % CYF_NR and (nstr + 1) * CYF_NR <= cap:
                nstr = nstr + 1
            for jb in range(nstr):
                j = jb * CYF_NR
                cyf_gemm_tile(q, ld, rows, kT + j, cap, D, sbuf + j, lds)
            j = nstr * CYF_NR
            if j < Lmax:  # the last, partial strip of keys
                for r in range(rows):
                    cyf_gemv_strip(q + r * ld, kT + j, cap, D, Lmax - j, sbuf + r * lds + j)
            for r in range(rows):
                t = t0 + r
                L = past + t + 1
                s = sbuf + r * lds
                _weights(s, L, S, inv_sqrt_d, scores, pattern, (h * T + t) * S)
                for j in range(L, Lmax):
                    s[j] = 0.0  # masked: exact zeros, so the sum below may run to Lmax
            # z rows = P_tile @ V, CYF_NR of the d_head columns at a time
            for db in range((D + CYF_NR - 1) // CYF_NR):
                d = db * CYF_NR
                dw = D - d if D - d < CYF_NR else CYF_NR
                if dw == CYF_NR:
                    cyf_gemm_tile(sbuf, lds, rows, vh + d, D, Lmax, tile, CYF_NR)
                    for r in range(rows):
                        for j in range(CYF_NR):
                            z[(t0 + r) * C + h * D + d + j] = tile[r * CYF_NR + j]
                else:
                    for r in range(rows):
                        cyf_gemv_strip(sbuf + r * lds, vh + d, D, Lmax, dw, zrow)
                        for j in range(dw):
                            z[(t0 + r) * C + h * D + d + j] = zrow[j]


cdef void attention(float* z, const float* qkv, float* k_cache, float* v_cache,
                    Py_ssize_t past, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
                    Py_ssize_t cap, float* scores, float* pattern,
                    float* scratch, int nthreads) noexcept nogil:
    _append_kv(qkv, k_cache, v_cache, past, T, H, G, D, cap, nthreads)
    if T < CYF_MR:
        _attend_rows(z, qkv, k_cache, v_cache, past, T, H, G, D, cap, scores, pattern, scratch, nthreads)
    else:
        _attend_tiles(z, qkv, k_cache, v_cache, past, T, H, G, D, cap, scores, pattern, scratch, nthreads)


def _heads(fn, n_head, G, D, qkv):
    """The query head count H for a cache of G key/value heads, checked
    against qkv's width (H + 2G) D."""
    cdef Py_ssize_t H = G if n_head is None else _checks.integer(fn, "n_head", n_head)
    if H < 1 or H % G:
        raise ValueError(f"{fn}: n_head={H} must be a positive multiple of the cache's "
                         f"{G} key/value heads")
    _checks.same_dim(fn, "qkv", qkv, 1, (H + 2 * G) * D, "(n_head + 2 n_kv_head) d_head")
    return H


def attention_forward(qkv, k_cache, v_cache, past, out=None, scores=None, pattern=None,
                      threads=None, workspace=None, n_head=None):
    """Causal self-attention of T new positions over a key/value cache.

    qkv     [T, (H + 2G) D]  float32: H query heads | G key heads | G value heads
    k_cache [G, D, cap], v_cache [G, cap, D]  float32, written at past..past+T-1
    past    positions already in the cache (0 for a fresh sequence)
    n_head  H, the query heads (default G: one key/value head per query head)
    out     [T, H D] per-head outputs z (allocated when None)
    scores, pattern  optional [H, T, past+T] outputs (pre-softmax with -inf
            on masked entries; softmax weights with 0 there)
    workspace  a linalg.Workspace for the scratch memory (per call when None)
    Returns out.
    """
    fn = "attention"
    f32(fn, "qkv", qkv, 2)
    f32(fn, "k_cache", k_cache, 3, True)
    f32(fn, "v_cache", v_cache, 3, True)
    cdef Py_ssize_t G = k_cache.shape[0], D = k_cache.shape[1], cap = k_cache.shape[2]
    cdef Py_ssize_t T = qkv.shape[0]
    if G < 1 or D < 1:
        raise ValueError(f"attention: k_cache must be [n_kv_head, d_head, cap] with both >= 1, "
                         f"got {k_cache.shape}")
    _checks.shape(fn, "v_cache", v_cache, (G, cap, D))
    cdef Py_ssize_t H = _heads(fn, n_head, G, D, qkv)
    cdef Py_ssize_t C = H * D
    past = _checks.integer(fn, "past", past)
    if past < 0 or past + T > cap:
        raise ValueError(f"attention: past={past} plus T={T} new positions does not fit "
                         f"a cache of {cap} positions")
    if T < 1:
        raise ValueError("attention: qkv must hold at least one position (T >= 1)")
    _checks.no_overlap(fn, "k_cache", k_cache, qkv=qkv, v_cache=v_cache)
    _checks.no_overlap(fn, "v_cache", v_cache, qkv=qkv)
    cdef Py_ssize_t S = past + T
    if out is None:
        out = np.empty((T, C), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, C))
        _checks.no_overlap(fn, "out", out, qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    for name, arr in (("scores", scores), ("pattern", pattern)):
        if arr is not None:
            f32(fn, name, arr, 3, True)
            _checks.shape(fn, name, arr, (H, T, S))
            _checks.no_overlap(fn, name, arr, qkv=qkv, k_cache=k_cache, v_cache=v_cache, out=out)
    if scores is not None:
        _checks.no_overlap(fn, "scores", scores, pattern=pattern)
    cdef int nt = _checks.threads(fn, threads)
    cdef list keep = []
    cdef float* pscr = scratch_floats(fn, workspace, nt * attention_scratch_size(cap, D), keep)
    cdef float* pz = wptr(out)
    cdef const float* pq = cptr(qkv)
    cdef float* pk = wptr(k_cache)
    cdef float* pv = wptr(v_cache)
    cdef float* psc = wptr(scores)
    cdef float* ppa = wptr(pattern)
    cdef Py_ssize_t p = past
    with nogil:
        attention(pz, pq, pk, pv, p, T, H, G, D, cap, psc, ppa, pscr, nt)
    return out


def rope_forward(qkv, n_head, n_kv_head, past, cos, sin, threads=None):
    """Rotary position embedding, in place on the query and key heads of
    qkv [T, (H + 2G) D] for positions past .. past+T-1; cos, sin [P, D/2]
    (P >= past + T).  Returns qkv."""
    fn = "rope"
    f32(fn, "qkv", qkv, 2, True)
    f32(fn, "cos", cos, 2)
    f32(fn, "sin", sin, 2)
    cdef Py_ssize_t T = qkv.shape[0]
    cdef Py_ssize_t H = _checks.integer(fn, "n_head", n_head)
    cdef Py_ssize_t G = _checks.integer(fn, "n_kv_head", n_kv_head)
    if G < 1 or H < 1 or H % G:
        raise ValueError(f"{fn}: n_head={H} must be a positive multiple of n_kv_head={G}")
    if qkv.shape[1] % (H + 2 * G):
        raise ValueError(f"{fn}: qkv's width {qkv.shape[1]} is not (n_head + 2 n_kv_head) d_head")
    cdef Py_ssize_t D = qkv.shape[1] // (H + 2 * G)
    if D % 2:
        raise ValueError(f"{fn}: d_head={D} must be even")
    _checks.same_dim(fn, "cos", cos, 1, D // 2, "d_head / 2")
    _checks.shape(fn, "sin", sin, cos.shape)
    past = _checks.integer(fn, "past", past)
    if past < 0 or past + T > cos.shape[0]:
        raise ValueError(f"{fn}: positions {past}..{past + T - 1} are outside the "
                         f"{cos.shape[0]}-position table")
    _checks.no_overlap(fn, "qkv", qkv, cos=cos, sin=sin)
    cdef int nt = _checks.threads(fn, threads)
    cdef float* pq = wptr(qkv)
    cdef const float* pc = cptr(cos)
    cdef const float* ps = cptr(sin)
    cdef Py_ssize_t p = past
    if T:
        with nogil:
            rope(pq, T, H, G, D, p, pc, ps, nt)
    return qkv

"""Linear algebra kernels: dot, linear (GEMM and GEMV paths), residual add, embedding.

Dimension letters: T rows (positions), K the summed (input) dimension,
N outputs, C = d_model.

Why the two paths: prefill multiplies many rows by the same weights and is
bound by arithmetic, so W is packed into contiguous strips of CYF_NR columns
and a CYF_MR x CYF_NR register tile (simd.h: 12 x 32 with AVX-512, 6 x 16
otherwise) reuses every loaded weight CYF_MR times.  Decode has one
row: every weight byte is used once, so the matrix-vector path is bound by
memory bandwidth and is shaped so that each thread streams one contiguous
run of W (see gemv_team).
"""

cimport cython
from cython.parallel cimport parallel, prange, threadid
from libc.string cimport memcpy, memset

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport gelu_erf, ACT_NONE, ACT_GELU_NEW, ACT_GELU_ERF

from cyformer import _checks

cnp.import_array()

from .simd cimport CYF_MR, CYF_NR, cyf_gemm_tile, cyf_dot, cyf_stream_sum, cyf_gelu_new_n, cyf_gemv_rows_b
from .team cimport cyf_team_size, cyf_barrier, cyf_next_item

cdef enum:
    # Columns per packed GEMM panel (8 strips of 16, or 4 of 32): the unit of
    # work per thread.
    GEMM_NC = 128
    # The last GEMM_TAIL_COLS (or more) columns go out in panels this wide.
    GEMM_TAIL_NC = 32
    GEMM_TAIL_COLS = 256
    # Widest panel of _gemm_direct (multiples of GEMM_NC).
    DIRECT_NC = 1024
    # Values of k per block of the transposed pack (one cache line of a row of W).
    PACK_KB = 16
    # Fewer rows of x than this skip the packing (_gemm_direct): below it the
    # packing cost more than it saved (measured up to ~96 rows, noisy beyond).
    # T * GEMM_NC floats of output tile must fit in a thread's panel scratch (T <= K).
    GEMM_DIRECT_ROWS = 64

from .activations import ACTIVATIONS


cdef Py_ssize_t gemv_partials_size(Py_ssize_t K, Py_ssize_t N) noexcept nogil:
    return (K + GEMV_ROWS - 1) // GEMV_ROWS * N


cdef inline Py_ssize_t _gemm_scratch(Py_ssize_t K) noexcept nogil:
    return K * GEMM_NC + CYF_MR * CYF_NR  # a packed panel and one output tile


cdef inline bint _qgemm_of(Wt W) noexcept nogil:
    # the format has an integer GEMM for W in its orientation
    return W.f.qgemm != NULL and W.t


cdef inline bint _bgemm_of(Wt W) noexcept nogil:
    # the format has a bfloat16 GEMM (bf16 activations) for W in its orientation
    return W.f.bgemm != NULL and W.t


cdef inline Py_ssize_t _lines(Py_ssize_t nbytes) noexcept nogil:
    # floats of whole 64-byte lines that hold nbytes
    return (nbytes + 63) // 64 * 16


cdef inline Py_ssize_t _qgemm_thread_scratch(Py_ssize_t K) noexcept nogil:
    return _lines(GEMM_NC // CYF_QNR * cyf_qstrip_bytes(K)) + CYF_QMR_MAX * CYF_QNR  # a packed panel, one tile


cdef inline Py_ssize_t _qgemm_rows_scratch(Py_ssize_t T, Py_ssize_t K) noexcept nogil:
    cdef Py_ssize_t nblk = (K + CYF_QB - 1) // CYF_QB
    return _lines(T * nblk * CYF_QB) + 2 * _lines(T * nblk * 4)  # codes, d, bsum of every row


cdef Py_ssize_t gemv_acc_size(Py_ssize_t B, Py_ssize_t K) noexcept nogil:
    # a thread's accumulators, then its copy of B rows of x as W [N, K]'s
    # format prepares them (any format's, so callers need not know which)
    return GEMV_COLS + B * CYF_PREP_FLOATS(K)


cdef inline Py_ssize_t _bgemm_thread_scratch(Py_ssize_t K) noexcept nogil:
    return _lines(GEMM_NC // CYF_BNR * cyf_bstrip_words(K) * 4) + CYF_BMR_MAX * CYF_BNR  # a packed panel, one tile


cdef inline Py_ssize_t _bgemm_rows_scratch(Py_ssize_t T, Py_ssize_t K) noexcept nogil:
    return _lines(T * ((K + 1) // 2) * 4)  # every row's bf16 pairs


cdef Py_ssize_t linear_scratch_size(Py_ssize_t T, Py_ssize_t K, Py_ssize_t N, Wt W,
                                    int nthreads) noexcept nogil:
    if T < MATVEC_ROWS:  # shared partial sums (W [K, N] only), accumulators per thread
        return (0 if W.t else gemv_partials_size(K, N)) + nthreads * gemv_acc_size(1, K)
    if _qgemm_of(W):
        return _qgemm_rows_scratch(T, K) + nthreads * _qgemm_thread_scratch(K)
    if _bgemm_of(W):
        return _bgemm_rows_scratch(T, K) + nthreads * _bgemm_thread_scratch(K)
    return nthreads * _gemm_scratch(K)


cdef float dot(const float* a, const float* b, Py_ssize_t n) noexcept nogil:
    return cyf_dot(a, b, n)


cdef inline void _finish(float* dst, float* acc, const float* bias, Py_ssize_t n,
                         int act, bint accumulate, const float* scale=NULL) noexcept nogil:
    # dst[j] (=|+=) act(acc[j] * scale[j] + bias[j]) for j < n (scale: int8
    # weights' per-output scales, NULL otherwise); acc is scratch and is
    # overwritten.  GELU-tanh goes through the vectorised exp in simd.h.
    cdef Py_ssize_t j
    if scale != NULL:
        for j in range(n):
            acc[j] = acc[j] * scale[j]
    if bias != NULL:
        for j in range(n):
            acc[j] = acc[j] + bias[j]
    if act == ACT_GELU_NEW:
        cyf_gelu_new_n(acc, n)
    elif act == ACT_GELU_ERF:
        for j in range(n):
            acc[j] = gelu_erf(acc[j])
    if accumulate:
        for j in range(n):
            dst[j] = dst[j] + acc[j]
    else:
        for j in range(n):
            dst[j] = acc[j]


cdef void _pack_panel(float* pack, Wt W, Py_ssize_t K, Py_ssize_t N,
                      Py_ssize_t n0, Py_ssize_t pw) noexcept nogil:
    # Columns n0 .. n0+pw of W into CYF_NR-column strips: pack[s][k][j] =
    # W(k, n0 + CYF_NR s + j), the last strip zero-padded, as scaled float32
    # (the format's pack_run / pack_t).  W is read in its own memory order
    # (whole row runs), which is what keeps this cheap when W comes from DRAM.
    cdef Py_ssize_t nfull = pw // CYF_NR, tail = pw % CYF_NR
    cdef Py_ssize_t j, si, kb, k0, kn, k
    cdef float* dst
    if tail:
        memset(pack + nfull * K * CYF_NR, 0, K * CYF_NR * sizeof(float))
    if W.t:  # W is [N, K]: CYF_NR rows of W become one strip, transposed
        # in blocks of PACK_KB values of k, so that the strided writes land
        # in a few KB that stay in L1 (a whole strip's column does not)
        for si in range(nfull + (1 if tail else 0)):
            for kb in range((K + PACK_KB - 1) // PACK_KB):
                k0 = kb * PACK_KB
                kn = K - k0 if K - k0 < PACK_KB else PACK_KB
                dst = pack + (si * K + k0) * CYF_NR
                for j in range(CYF_NR if si < nfull else tail):
                    W.f.pack_t(dst + j, CYF_NR, &W, n0 + si * CYF_NR + j, k0, kn, K)
    else:  # W is [K, N]: each row of W scatters CYF_NR-float runs into the strips
        for k in range(K):
            for si in range(nfull):
                W.f.pack_run(pack + (si * K + k) * CYF_NR, &W, N, k, n0 + si * CYF_NR, CYF_NR)
            if tail:
                W.f.pack_run(pack + (nfull * K + k) * CYF_NR, &W, N, k, n0 + nfull * CYF_NR, tail)


cdef inline Py_ssize_t _gemm_tail_start(Py_ssize_t N) noexcept nogil:
    # first column of the narrow tail panels: the last GEMM_TAIL_COLS or more
    # columns, starting on a GEMM_NC boundary (everything when N is small)
    if N <= GEMM_TAIL_COLS:
        return 0
    return (N - GEMM_TAIL_COLS) // GEMM_NC * GEMM_NC


cdef inline Py_ssize_t _gemm_nitems(Py_ssize_t N) noexcept nogil:
    # the GEMMs' work items: panels of GEMM_NC columns, then GEMM_TAIL_NC-wide ones
    cdef Py_ssize_t tail0 = _gemm_tail_start(N)
    return tail0 // GEMM_NC + (N - tail0 + GEMM_TAIL_NC - 1) // GEMM_TAIL_NC


cdef inline Py_ssize_t _gemm_panel_start(Py_ssize_t p, Py_ssize_t N) noexcept nogil:
    # first column of work item p
    cdef Py_ssize_t tail0 = _gemm_tail_start(N)
    cdef Py_ssize_t nwide = tail0 // GEMM_NC
    return p * GEMM_NC if p < nwide else tail0 + (p - nwide) * GEMM_TAIL_NC


cdef inline Py_ssize_t _gemm_panel_width(Py_ssize_t n0, Py_ssize_t N) noexcept nogil:
    # columns of the work item starting at n0
    if n0 < _gemm_tail_start(N):
        return GEMM_NC
    return N - n0 if N - n0 < GEMM_TAIL_NC else GEMM_TAIL_NC


cdef void _gemm(float* out, const float* x, Wt W, const float* b,
                Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    # Panels of GEMM_NC columns are split over threads.  Each panel is packed
    # once, then every 6-row tile of x (in L1) runs across the panel's strips
    # (in L2), each output tile finished in registers by the tile kernel.
    # A wide panel of a 512-row prefill is ~1 ms of work, so the last columns
    # go out in GEMM_TAIL_NC-wide panels: the thread that finishes first then
    # waits for a narrow panel, not a wide one.  Every output is the same
    # sum whatever panel it falls in.
    cdef Py_ssize_t nitems = _gemm_nitems(N)
    cdef Py_ssize_t p, n0, pw, nstr, si, ns0, nw, tt, t0, r
    cdef int rows
    cdef float* pack
    cdef float* tile
    with parallel(num_threads=nthreads):
        pack = scratch + threadid() * _gemm_scratch(K)
        tile = pack + K * GEMM_NC
        for p in prange(nitems, schedule="dynamic", chunksize=1):
            n0 = _gemm_panel_start(p, N)
            pw = _gemm_panel_width(n0, N)
            nstr = (pw + CYF_NR - 1) // CYF_NR
            _pack_panel(pack, W, K, N, n0, pw)
            for tt in range((T + CYF_MR - 1) // CYF_MR):
                t0 = tt * CYF_MR
                rows = <int>(T - t0 if T - t0 < CYF_MR else CYF_MR)
                for si in range(nstr):
                    ns0 = n0 + si * CYF_NR
                    nw = N - ns0 if N - ns0 < CYF_NR else CYF_NR
                    cyf_gemm_tile(x + t0 * K, K, rows, pack + si * K * CYF_NR, CYF_NR, K, tile, CYF_NR)
                    for r in range(rows):
                        _finish(out + (t0 + r) * N + ns0, tile + r * CYF_NR,
                                b + ns0 if b != NULL else NULL, nw, act, accumulate)


cdef void _gemm_q(float* out, const float* x, Wt W, const float* b,
                  Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                  int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    # The integer GEMM of a format with a qgemm (int8, int4; qgemm.h): every
    # row of x quantized once as decode does it (rows split over threads),
    # then _gemm's panels, each packed into int8 strips, and tiles of
    # g.mr rows whose sums are the matrix-vector path's, bit for bit:
    # partial sums over GEMV_ROWS inputs, added in order, then _finish.
    cdef const cyf_qgemm* g = W.f.qgemm
    cdef Py_ssize_t nblk = (K + CYF_QB - 1) // CYF_QB
    cdef Py_ssize_t sb = cyf_qstrip_bytes(K)
    cdef signed char* q = <signed char*>scratch
    cdef float* d = scratch + _lines(T * nblk * CYF_QB)
    cdef int* bsum = <int*>(d + _lines(T * nblk * 4))
    cdef float* per = <float*>(bsum) + _lines(T * nblk * 4)
    cdef Py_ssize_t nitems = _gemm_nitems(N)
    cdef Py_ssize_t t, p, n0, pw, nstr, si, ns0, nw, tt, t0, r
    cdef int rows
    cdef unsigned char* panel
    cdef float* tile
    with parallel(num_threads=nthreads):  # one team for both steps: a barrier between, no second fork
        for t in prange(T, schedule="static"):
            cyf_q8_row_gemm(x + t * K, K, q + t * nblk * CYF_QB, d + t * nblk, bsum + t * nblk)
        cyf_barrier()
        panel = <unsigned char*>(per + threadid() * _qgemm_thread_scratch(K))
        tile = per + threadid() * _qgemm_thread_scratch(K) + _lines(GEMM_NC // CYF_QNR * sb)
        for p in prange(nitems, schedule="dynamic", chunksize=1):
            n0 = _gemm_panel_start(p, N)
            pw = _gemm_panel_width(n0, N)
            nstr = (pw + CYF_QNR - 1) // CYF_QNR
            g.pack_t(panel, &W, K, N, n0, pw)
            for tt in range((T + g.mr - 1) // g.mr):
                t0 = tt * g.mr
                rows = <int>(T - t0 if T - t0 < g.mr else g.mr)
                for si in range(nstr):
                    ns0 = n0 + si * CYF_QNR
                    nw = N - ns0 if N - ns0 < CYF_QNR else CYF_QNR
                    g.tile(tile, q + t0 * nblk * CYF_QB, d + t0 * nblk, bsum + t0 * nblk, rows,
                           panel + si * sb, nblk, GEMV_ROWS // CYF_QB)
                    for r in range(rows):
                        _finish(out + (t0 + r) * N + ns0, tile + r * CYF_QNR, b + ns0 if b != NULL else NULL,
                                nw, act, accumulate, W.scale + ns0 if W.f.out_scale else NULL)


cdef void _gemm_b(float* out, const float* x, Wt W, const float* b,
                  Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                  int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    # The bfloat16 GEMM of a format with a bgemm (bgemm.h), _gemm_q's shape:
    # every row of x rounded once to bf16 pairs as decode does (rows split
    # over threads), then _gemm's panels, each packed into pair strips
    # (from W [K, N] or [N, K]), and tiles of g.mr rows whose sums are
    # the matrix-vector path's (partial sums over GEMV_ROWS inputs, added in
    # order), then _finish.
    cdef const cyf_bgemm* g = W.f.bgemm
    cdef Py_ssize_t np2 = (K + 1) // 2
    cdef Py_ssize_t sw = cyf_bstrip_words(K)
    cdef unsigned int* xp = <unsigned int*>scratch
    cdef float* per = scratch + _bgemm_rows_scratch(T, K)
    cdef Py_ssize_t nitems = _gemm_nitems(N)
    cdef Py_ssize_t t, p, n0, pw, nstr, si, ns0, nw, tt, t0, r
    cdef int rows
    cdef unsigned int* panel
    cdef float* tile
    with parallel(num_threads=nthreads):  # one team for both steps: a barrier between, no second fork
        for t in prange(T, schedule="static"):
            cyf_bf16_pairs_of(x + t * K, K, xp + t * np2, np2)
        cyf_barrier()
        panel = <unsigned int*>(per + threadid() * _bgemm_thread_scratch(K))
        tile = per + threadid() * _bgemm_thread_scratch(K) + _lines(GEMM_NC // CYF_BNR * sw * 4)
        for p in prange(nitems, schedule="dynamic", chunksize=1):
            n0 = _gemm_panel_start(p, N)
            pw = _gemm_panel_width(n0, N)
            nstr = (pw + CYF_BNR - 1) // CYF_BNR
            g.pack_t(panel, &W, K, N, n0, pw)
            for tt in range((T + g.mr - 1) // g.mr):
                t0 = tt * g.mr
                rows = <int>(T - t0 if T - t0 < g.mr else g.mr)
                for si in range(nstr):
                    ns0 = n0 + si * CYF_BNR
                    nw = N - ns0 if N - ns0 < CYF_BNR else CYF_BNR
                    g.tile(tile, xp + t0 * np2, np2, rows, panel + si * sw, np2, GEMV_ROWS // 2)
                    for r in range(rows):
                        _finish(out + (t0 + r) * N + ns0, tile + r * CYF_BNR, b + ns0 if b != NULL else NULL,
                                nw, act, accumulate)


cdef void gemv_cols(float* out, const float* x, Wt W, const float* b,
                    Py_ssize_t K, Py_ssize_t N, Py_ssize_t n0, Py_ssize_t n1,
                    int act, bint accumulate, float* acc) noexcept nogil:
    # Outputs n0 .. n1-1 of x @ W.T for W [N, K]: one contiguous dot product
    # per output (the format's dot_t), so the range is one contiguous run of W.
    cdef Py_ssize_t a = n0, nw
    while a < n1:
        nw = n1 - a if n1 - a < GEMV_COLS else GEMV_COLS
        W.f.dot_t(acc, x, &W, a, nw, K)
        _finish(out + a, acc, b + a if b != NULL else NULL, nw, act, accumulate,
                W.scale + a if W.f.out_scale else NULL)
        a += nw


cdef void _gemv_cols_rows(float* out, Py_ssize_t ldo, const float* x, Py_ssize_t ldx, Py_ssize_t B,
                          Wt W, const float* b, Py_ssize_t K, Py_ssize_t N, Py_ssize_t n0, Py_ssize_t n1,
                          int act, bint accumulate, float* acc) noexcept nogil:
    # gemv_cols for B rows of x through the format's dot_t_rows: each row of
    # W, read once, against every row of x, so each output is that of the
    # one-row product.  acc holds [rows, outputs] for at most GEMV_COLS
    # floats at a time.
    cdef Py_ssize_t a, nw, r0, nr, r
    cdef Py_ssize_t rows = GEMV_COLS // GEMV_B_ROWS_T
    r0 = 0
    while r0 < B:
        nr = B - r0 if B - r0 < rows else rows
        a = n0
        while a < n1:
            nw = n1 - a if n1 - a < GEMV_B_ROWS_T else GEMV_B_ROWS_T
            W.f.dot_t_rows(acc, x + r0 * ldx, ldx, <int>nr, &W, a, nw, K)
            for r in range(nr):
                _finish(out + (r0 + r) * ldo + a, acc + r * nw, b + a if b != NULL else NULL, nw, act,
                        accumulate, W.scale + a if W.f.out_scale else NULL)
            a += nw
        r0 += nr


cdef void _gemv_cols_prep(float* out, Py_ssize_t ldo, const unsigned char* xp, Py_ssize_t lp, Py_ssize_t B,
                          Wt W, const float* b, Py_ssize_t K, Py_ssize_t n0, Py_ssize_t n1,
                          int act, bint accumulate, float* acc) noexcept nogil:
    # Outputs n0 .. n1-1 for B rows of x prepared by the format (lp bytes
    # apart): every row of W, read once, against every row of x, so each
    # output is that of the one-row product.  acc holds [rows, outputs],
    # at most GEMV_COLS floats at a time.
    cdef Py_ssize_t a, nw, r0, nr, r
    cdef Py_ssize_t rows = GEMV_COLS // GEMV_B_ROWS_T
    cdef Py_ssize_t width = GEMV_COLS if B == 1 else GEMV_B_ROWS_T
    r0 = 0
    while r0 < B:
        nr = B - r0 if B - r0 < rows else rows
        a = n0
        while a < n1:
            nw = n1 - a if n1 - a < width else width
            W.f.dot_tp_rows(acc, xp + r0 * lp, lp, <int>nr, &W, a, nw, K)
            for r in range(nr):
                _finish(out + (r0 + r) * ldo + a, acc + r * nw, b + a if b != NULL else NULL, nw, act,
                        accumulate, W.scale + a if W.f.out_scale else NULL)
            a += nw
        r0 += nr


cdef void gemv_team(float* out, const float* x, Wt W, Py_ssize_t K, Py_ssize_t N,
                    Epilogue ep, float* partials, float* acc, Team team) noexcept nogil:
    gemv_team_rows(out, N, x, K, 1, W, K, N, ep, partials, acc, team)


cdef void gemv_team_rows(float* out, Py_ssize_t ldo, const float* x, Py_ssize_t ldx, Py_ssize_t B,
                         Wt W, Py_ssize_t K, Py_ssize_t N, Epilogue ep, float* partials, float* acc,
                         Team team) noexcept nogil:
    # Each thread must stream long contiguous runs of W: two threads reading
    # the two halves of every row ran 20-25 % slower (measured on 768x3072
    # and 3072x768) than two threads each reading its own block of rows.
    # So for W [K, N] the rows are cut into fixed blocks of GEMV_ROWS, which
    # the threads take one at a time from a shared counter (on a shared
    # machine a fixed split leaves the faster thread waiting); each block is
    # summed into its own partial vector, and after a barrier each thread
    # adds up the partials of its output range in block order.  The blocks
    # do not depend on the team, so neither do the results.  The last few
    # blocks are handed out in column pieces, so that the thread that
    # finishes first waits for a fraction of a block rather than a whole one.
    # With B rows of x, each piece of a block is read from DRAM once and
    # then serves every row from the cache (pieces of GEMV_B_COLS columns
    # stay in L2; the register tile reads each weight once for all rows,
    # taking the block's whole rows and prefetching as it goes); every row's
    # sums are those of a one-row product.
    cdef Py_ssize_t per = gemv_per_thread(N, team.size)
    cdef Py_ssize_t n0 = team.tid * per
    cdef Py_ssize_t* counter = team.counter
    cdef const float* b = ep.bias
    cdef int act = ep.act
    cdef bint accumulate = ep.accumulate
    cdef Py_ssize_t n1 = N if N < n0 + per else n0 + per
    cdef Py_ssize_t nb, blk, k0, kb, c0, c1, cw, j, ntail, nitems, item, pw, r, e, maxw
    cdef float* p0
    cdef const float* pb
    cdef unsigned char* xp = NULL
    cdef Py_ssize_t lp = 0
    cdef bint tile
    if W.t:  # W [N, K]: a range of outputs already is a contiguous run
        # outputs are independent dot products: the split never changes a bit
        pw = (N + GEMV_T_ITEMS * team.size - 1) // (GEMV_T_ITEMS * team.size)
        pw = (pw + 15) // 16 * 16
        pw = GEMV_T_ROWS if pw > GEMV_T_ROWS else pw
        nb = (N + pw - 1) // pw
        if W.f.prep != NULL:  # x prepared once per product, into this thread's scratch after acc
            xp = <unsigned char*>(acc + GEMV_COLS)
            lp = W.f.prep_bytes(K)
            for r in range(B):
                W.f.prep(xp + r * lp, x + r * ldx, K)
        blk = cyf_next_item(counter)
        while blk < nb:
            c0 = blk * pw
            c1 = N if N < c0 + pw else c0 + pw
            if W.f.prep != NULL:
                _gemv_cols_prep(out, ldo, xp, lp, B, W, b, K, c0, c1, act, accumulate, acc)
            elif B == 1:
                gemv_cols(out, x, W, b, K, N, c0, c1, act, accumulate, acc)
            elif W.f.dot_t_rows != NULL and B >= GEMV_TILE_ROWS:
                _gemv_cols_rows(out, ldo, x, ldx, B, W, b, K, N, c0, c1, act, accumulate, acc)
            else:
                while c0 < c1:  # a few rows of W, then every row of x against them
                    e = c1 if c1 < c0 + GEMV_B_ROWS_T else c0 + GEMV_B_ROWS_T
                    for r in range(B):
                        gemv_cols(out + r * ldo, x + r * ldx, W, b, K, N, c0, e, act, accumulate, acc)
                    c0 = e
            blk = cyf_next_item(counter)
        # as below: the counter is 0 again for the next product (a block
        # matrix stored [N, K], q8_0's, shares the counter of [K, N] ones)
        team_barrier(team)
        if team.tid == 0:
            counter[0] = 0
        return
    nb = (K + GEMV_ROWS - 1) // GEMV_ROWS
    ntail = GEMV_TAIL_BLOCKS if nb > GEMV_TAIL_BLOCKS else nb
    # the last ntail blocks are cut into GEMV_TAIL_PIECES column ranges
    nitems = nb - ntail + ntail * GEMV_TAIL_PIECES
    pw = (N + GEMV_TAIL_PIECES - 1) // GEMV_TAIL_PIECES
    pw = (pw + 15) // 16 * 16
    tile = B >= GEMV_TILE_ROWS and W.f.gemv_block_rows != NULL  # each weight loaded once for all rows
    maxw = GEMV_COLS if B == 1 else N if tile else GEMV_B_COLS
    item = cyf_next_item(counter)
    while item < nitems:
        if item < nb - ntail:
            blk, c0, c1 = item, 0, N
        else:
            blk = nb - ntail + (item - (nb - ntail)) // GEMV_TAIL_PIECES
            c0 = (item - (nb - ntail)) % GEMV_TAIL_PIECES * pw
            c1 = N if N < c0 + pw else c0 + pw
        k0 = blk * GEMV_ROWS
        kb = K - k0 if K - k0 < GEMV_ROWS else GEMV_ROWS
        while c0 < c1:  # the partial row stays in L1 while W streams past
            cw = c1 - c0 if c1 - c0 < maxw else maxw
            if tile:
                W.f.gemv_block_rows(partials + blk * N + c0, nb * N, x, ldx, <int>B, &W, k0, kb, c0, cw)
            else:
                for r in range(B):
                    W.f.gemv_block(partials + (r * nb + blk) * N + c0, x + r * ldx, &W, k0, kb, c0, cw, N, acc)
            c0 += cw
        item = cyf_next_item(counter)
    team_barrier(team)
    if team.tid == 0:  # every thread has drawn its last item: ready for the next product
        counter[0] = 0
    if n0 < n1:
        for r in range(B):
            p0 = partials + r * nb * N + n0
            for blk in range(1, nb):
                pb = p0 + blk * N
                for j in range(n1 - n0):
                    p0[j] = p0[j] + pb[j]
            _finish(out + r * ldo + n0, p0, b + n0 if b != NULL else NULL, n1 - n0, act, accumulate,
                    W.scale + n0 if W.f.out_scale else NULL)


cdef void _gemv(float* out, const float* x, Wt W, const float* b,
                Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    cdef float* partials = scratch
    cdef float* accs = scratch + (0 if W.t else gemv_partials_size(K, N))
    cdef Py_ssize_t counters[MATVEC_ROWS]  # one per row (T < MATVEC_ROWS)
    cdef cyf_bar bar
    cdef Py_ssize_t t
    cdef Team team
    cdef Epilogue ep
    ep.bias, ep.act, ep.accumulate = b, act, accumulate
    for t in range(T):
        counters[t] = 0
    memset(&bar, 0, sizeof(bar))
    with parallel(num_threads=nthreads):
        for t in range(T):
            team = team_of(threadid(), cyf_team_size(), &counters[t], &bar)
            gemv_team(out + t * N, x + t * K, W, K, N, ep, partials,
                      accs + team.tid * gemv_acc_size(1, K), team)
            team_barrier(team)  # the partials are reused by the next row


cdef void _gemm_direct(float* out, const float* x, Wt W, const float* b,
                       Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                       int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    # _gemm for a few rows of x and float32 W [K, N], without packing: with
    # so few rows the packing was most of the work (T = 4 took as long as
    # T = 12).  The register tile reads W's strips where they lie, and every
    # output is the GEMM's chain (multiply-adds over k = 0..K-1 from zero),
    # so the results are bitwise those of _gemm.  Panels are as wide as two
    # per thread allow (up to DIRECT_NC): the tile prefetches along a row
    # of W, and longer runs of it stream better (one core, x [8, 768] @
    # 768x3072 from DRAM: 128-column panels 1.54-1.59 ms, wide ones
    # bench/results/2026-11-26-batch-step-prefetch-amd-epyc.md).
    cdef Py_ssize_t nc = N // (2 * nthreads) // GEMM_NC * GEMM_NC
    cdef Py_ssize_t fit = K * GEMM_NC // T // GEMM_NC * GEMM_NC  # the tile [T, nc] in the panel scratch
    nc = DIRECT_NC if nc > DIRECT_NC else nc
    nc = fit if nc > fit else nc
    nc = GEMM_NC if nc < GEMM_NC else nc
    cdef Py_ssize_t npanel = (N + nc - 1) // nc
    cdef Py_ssize_t p, n0, pw, r
    cdef float* tile
    with parallel(num_threads=nthreads):
        tile = scratch + threadid() * _gemm_scratch(K)
        for p in prange(npanel, schedule="dynamic", chunksize=1):
            n0 = p * nc
            pw = N - n0 if N - n0 < nc else nc
            cyf_gemv_rows_b(x, K, <int>T, <const float*>W.data + n0, W.ld, K, pw, tile, pw)
            for r in range(T):
                _finish(out + r * N + n0, tile + r * pw, b + n0 if b != NULL else NULL, pw, act, accumulate)


cdef void linear(float* out, const float* x, Wt W, const float* b,
                 Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                 int act, bint accumulate, float* scratch, int nthreads) noexcept nogil:
    if T <= 0 or N <= 0:
        return
    if T < MATVEC_ROWS:
        _gemv(out, x, W, b, T, K, N, act, accumulate, scratch, nthreads)
    elif _qgemm_of(W):  # the format's integer GEMM
        _gemm_q(out, x, W, b, T, K, N, act, accumulate, scratch, nthreads)
    elif _bgemm_of(W):  # the format's bfloat16 GEMM
        _gemm_b(out, x, W, b, T, K, N, act, accumulate, scratch, nthreads)
    elif T < GEMM_DIRECT_ROWS and T <= K and W.f.in_place and not W.t:
        _gemm_direct(out, x, W, b, T, K, N, act, accumulate, scratch, nthreads)
    else:
        _gemm(out, x, W, b, T, K, N, act, accumulate, scratch, nthreads)


cdef void add(float* out, const float* x, Py_ssize_t n, int nthreads) noexcept nogil:
    cdef Py_ssize_t i
    for i in prange(n, num_threads=nthreads, schedule="static"):
        out[i] = out[i] + x[i]


cdef void dequant_row(float* out, Wt W, Py_ssize_t n, Py_ssize_t K) noexcept nogil:
    cyf_dequant_row_t(out, &W, n, K)


cdef void embed(float* out, const long long* ids, Wt wte, const float* wpe,
                Py_ssize_t T, Py_ssize_t C, Py_ssize_t pos0, int nthreads) noexcept nogil:
    cdef Py_ssize_t t, c
    cdef const float* pos
    if T <= 0:
        return
    for t in prange(T, num_threads=nthreads if nthreads < T else <int>T, schedule="static"):
        dequant_row(out + t * C, wte, ids[t], C)
        if wpe != NULL:  # rotary models: positions enter in attention instead
            pos = wpe + (pos0 + t) * C
            for c in range(C):
                out[t * C + c] = out[t * C + c] + pos[c]


# ---------------------------------------------------------------------------
# Python-facing wrappers: validate everything, allocate, pick the threads.

def aligned_empty(n):
    """An uninitialised float32 array of n elements starting on a 64-byte
    cache line.  NumPy's large arrays start 16 bytes past a page, so every
    64-byte load of a packed GEMM panel there would straddle two lines
    (measured: the tile kernel 4-6 % slower at x86-64-v4)."""
    n = _checks.integer("aligned_empty", "n", n)
    if n < 0:
        raise ValueError(f"aligned_empty: n must be >= 0, got {n}")
    buf = np.empty(n + 16, dtype=np.float32)
    cdef Py_ssize_t skip = (-buf.ctypes.data % 64) // 4
    return buf[skip:skip + n]


cdef class Workspace:
    """float32 memory that kernel calls reuse instead of allocating.

    A fresh NumPy array of a few MB is mapped anew on every call, and the
    kernel then zeroes each of its pages on first touch: at GPT-2-small
    geometry that was 12 % of a 512-token prefill.  A Workspace keeps its
    buffers, growing them to the largest size asked for:

        array(name, shape)  a float32 array of that shape, the same memory
                            every time the name is asked for again (so the
                            previous array of that name is overwritten);
        kernel wrappers that take ``workspace=`` keep their scratch here.

    It is not thread-safe: give each calling thread its own.
    """

    def __init__(self):
        self.arrays = {}

    def array(self, name, shape):
        """A float32 C-contiguous array of ``shape`` from the buffer ``name``
        (new buffers are zeroed, reused ones hold what was written last)."""
        try:
            shape = tuple(_checks.integer("Workspace.array", "shape", d) for d in shape)
        except TypeError:
            raise ValueError(f"Workspace.array: shape must be a sequence of integers, got {shape!r}") from None
        n = 1
        for d in shape:
            if d < 0:
                raise ValueError(f"Workspace.array: negative dimension in {shape}")
            n *= d
        buf = self.arrays.get(name)
        if buf is None or buf.size < n:
            buf = self.arrays[name] = aligned_empty(n)
            buf[...] = 0
        return buf[:n].reshape(shape)

    @property
    def nbytes(self):
        """Bytes held by all buffers."""
        return sum(b.nbytes for b in self.arrays.values())

    cdef float* scratch(self, Py_ssize_t n) except NULL:
        return wptr(self.array("scratch", (max(n, 1),)))


cdef float* scratch_floats(str fn, object workspace, Py_ssize_t n, list keep) except NULL:
    if workspace is None:
        buf = aligned_empty(max(n, 1))
        keep.append(buf)
        return wptr(buf)
    if not isinstance(workspace, Workspace):
        raise ValueError(f"{fn}: workspace must be a Workspace (cyformer.kernels.linalg) or None, "
                         f"got {type(workspace).__name__}")
    return (<Workspace>workspace).scratch(n)


def dot_product(a, b):
    """sum(a * b) for two 1-D float32 arrays of equal length."""
    f32("dot", "a", a, 1)
    f32("dot", "b", b, 1)
    _checks.same_dim("dot", "b", b, 0, a.shape[0], "len(a)")
    cdef const float* pa = cptr(a)
    cdef const float* pb = cptr(b)
    cdef Py_ssize_t n = a.shape[0]
    cdef float r = 0.0
    if n:
        with nogil:
            r = dot(pa, pb, n)
    return float(r)


from cyformer import formats as _formats


def _check_format_table():
    # formats.py's records and formats.h's rows must name the same formats
    # at the same codes: the records say which row a Packed matrix reads.
    for name, f in _formats.TABLE.items():
        row = cyf_format_at(f.code)
        if row == NULL or row.name.decode() != name:
            raise ImportError(f"cyformer kernels: format {name!r} (code {f.code}) has no row in formats.h")
    if CYF_NFORMATS != len(_formats.TABLE):
        raise ImportError(f"cyformer kernels: formats.h has {CYF_NFORMATS} rows, formats.py {len(_formats.TABLE)}")


_check_format_table()


# cyformer._runtime.cpu_features() names -> the bits cyf_formats_select reads.
# Two are for tests only, never chosen by default: amx_model, the AMX tile
# run on amx.h's C model of the instructions, and avx_vnni_evex, the
# AVX-VNNI tile with AVX512-VNNI's encoding of vpdpbusd.
_FEATURE_BITS = {"avx512_vnni": 1, "avx512_bf16": 2, "avx2": 4, "amx_int8": 8, "amx_model": 16,
                 "avx_vnni": 32, "avx_vnni_evex": 64, "amx_bf16": 128}
_TEST_ONLY = ("amx_model", "avx_vnni_evex")
_AMX_OFF = set()  # this CPU's AMX features that failed the check at import (_select_at_import)
# Which AMX tiles run by default where the CPU has them.  Not the integer one:
# on a Sapphire Rapids-class Xeon it is slower than the AVX512-VNNI tile, since
# every 32-input block's int32 sums leave the tiles to be scaled by that
# block's activation scale (bench/results/2026-11-26-amx-xeon.md); it runs
# when asked for (select_format_kernels(dict(..., amx_int8=True))).
_AMX_DEFAULT = {"amx_int8": False, "amx_bf16": True}


def _cpu_features():
    # cpu_features() names what lies beyond the x86-64 level; the kernels
    # compiled for AVX2 by function run in every build, so the level counts
    # too.  AMX counts only with its tile state granted by the OS, and the
    # tile is built beside the AVX512-VNNI kernels.
    from cyformer import _runtime
    f = _runtime.cpu_features()
    vnni_built, level = bool(CYF_HAVE_VNNI_KERNELS), _runtime.x86_level()
    return dict(f, avx2=level >= 3, avx_vnni=f["avx_vnni"] and level >= 3 and bool(CYF_HAVE_AVXVNNI_KERNELS),
                avx_vnni_evex=f["avx512_vnni"] and level >= 4,
                amx_int8=f["amx_int8"] and f["amx_tile"] and f["amx_os"] and vnni_built,
                amx_bf16=f["amx_bf16"] and f["amx_tile"] and f["amx_os"] and bool(CYF_HAVE_BF16DP_KERNELS),
                amx_model=vnni_built and f["avx512_vnni"])


def select_format_kernels(features=None):
    """Point each format's row at the kernels for ``features`` ({name: bool},
    as cyformer._runtime.cpu_features(), plus "avx2": x86-64-v3; None: this
    CPU's).  Done once at import; tests call it to run each variant the CPU
    has.  Returns the features used."""
    have = _cpu_features()
    if features is None:
        features = dict(have, **{f: have[f] and _AMX_DEFAULT[f] and f not in _AMX_OFF for f in _AMX_DEFAULT},
                        **dict.fromkeys(_TEST_ONLY, False))
    if not isinstance(features, dict):
        raise TypeError(f"select_format_kernels: features must be a dict of feature name -> bool, "
                        f"got {type(features).__name__}")
    unknown = sorted(str(n) for n in features if n not in have)
    if unknown:
        raise ValueError(f"select_format_kernels: unknown CPU features {unknown}; "
                         f"known: {sorted(have)}")
    bits = 0
    for name, bit in _FEATURE_BITS.items():
        if features.get(name):
            if not have.get(name):
                raise ValueError(f"select_format_kernels: this CPU has no {name}")
            bits |= bit
    used = cyf_formats_select(bits)
    return {name: bool(used & bit) for name, bit in _FEATURE_BITS.items()}



def format_kernels():
    """{format name: what computes with it on this CPU, in words}."""
    return {name: cyf_format_at(f.code).kernels.decode() for name, f in _formats.TABLE.items()}


def integer_gemm(fmt):
    """True when a product of fmt's matrices with 4 or more rows (prefill)
    runs this CPU's integer GEMM (int8 activations, as decode), False when
    it widens the weights to float32 panels."""
    cdef const cyf_format* f = cyf_format_at(_formats.format_of("integer_gemm", fmt).code)
    return f.qgemm != NULL


def prefill_gemm(fmt, transposed=False):
    """What a product of fmt's matrices with 4 or more rows (prefill) runs on
    this CPU, named by the activations' type: "int8" (the integer GEMM, x
    quantized as decode does), "bfloat16" (the bfloat16 GEMM: x rounded to
    bf16, vdpbf16ps), or "float32" (the weights widened to float32 panels).
    transposed: for matrices stored [N, K] (a row per output; a rows_out
    format's matrices always are)."""
    rec = _formats.format_of("prefill_gemm", fmt)
    cdef const cyf_format* f = cyf_format_at(rec.code)
    cdef bint t = transposed or rec.rows_out
    if f.qgemm != NULL and t:
        return "int8"
    if f.bgemm != NULL and t:
        return "bfloat16"
    return "float32"


def prep_bytes(fmt, Py_ssize_t K):
    """(bytes fmt's kernels prepare a row of K inputs into, the scratch
    reserved for it) for W [N, K] on this CPU, or None where fmt's kernels
    read x as it is."""
    cdef const cyf_format* f = cyf_format_at(_formats.format_of("prep_bytes", fmt).code)
    if K < 0:
        raise ValueError(f"prep_bytes: K must be >= 0, got {K}")
    if f.prep == NULL:
        return None
    return f.prep_bytes(K), 4 * CYF_PREP_FLOATS(K)


cdef Wt weights_of(str fn, str name, object W, Py_ssize_t K, bint w_transposed, list keep) except *:
    cdef Wt w
    if isinstance(W, np.ndarray):
        f32(fn, name, W, 2)
        _checks.same_dim(fn, name, W, 1 if w_transposed else 0, K, "x.shape[1]")
        keep.append(W)
        return f32_weights(cptr(W), w_transposed, W.shape[1])
    # a cyformer.formats.Packed matrix: data as stored, scales, logical shape
    f = _formats.TABLE.get(getattr(W, "fmt", None)) if isinstance(getattr(W, "fmt", None), str) else None
    if f is None or f.layout is None:
        raise ValueError(f"{fn}: {name} must be a float32 array or a cyformer.formats.Packed matrix, "
                         f"got {type(W).__name__}")
    if bool(W.transposed) != bool(w_transposed):
        raise ValueError(f"{fn}: {name} is stored {'[N, K]' if W.transposed else '[K, N]'}; "
                         f"w_transposed={w_transposed} says otherwise")
    shape = tuple(W.shape)
    rows, cols = (shape[1], shape[0]) if w_transposed else shape  # (K, N)
    if rows != K:
        raise ValueError(f"{fn}: {name} has {rows} inputs, x has {K}")
    nd, sshape = f.layout(rows, cols, w_transposed)
    data = W.data
    if (not isinstance(data, np.ndarray) or data.dtype != f.storage or data.shape != nd
            or not data.flags.c_contiguous):
        raise ValueError(f"{fn}: {name}'s {f.name} data must be a C-contiguous {np.dtype(f.storage).name} "
                         f"array of shape {nd}")
    keep.append(data)
    # a rows_out format (q8_0) holds a row per output whatever the matrix: read [N, K]
    w.data, w.f, w.t, w.ld, w.scale = (cnp.PyArray_DATA(<cnp.ndarray>data), cyf_format_at(f.code),
                                       w_transposed or f.rows_out, nd[1], NULL)
    if sshape is not None:
        sc = f32(fn, f"{name}.scale", W.scale, len(sshape))
        _checks.shape(fn, f"{name}.scale", sc, sshape)
        keep.append(sc)
        w.scale = cptr(sc)
    return w


def linear_forward(x, W, b=None, out=None, *, w_transposed=False, activation="none",
                   accumulate=False, threads=None, workspace=None):
    """out = act(x @ W + b), or out += act(x @ W + b) with accumulate=True.

    x [T, K]; W [K, N] ([N, K] with w_transposed=True): a float32 array or a
    cyformer.formats.Packed matrix (bfloat16, int8, int4); b [N] or None;
    out [T, N] (allocated when None; required with accumulate).
    activation: "none", "gelu_new" (tanh approximation) or "gelu" (erf).
    workspace: a Workspace for the scratch memory (allocated per call when None).
    """
    fn = "linear"
    f32(fn, "x", x, 2)
    cdef Py_ssize_t T = x.shape[0], K = x.shape[1]
    cdef list keep = []
    cdef Wt w = weights_of(fn, "W", W, K, bool(w_transposed), keep)
    cdef Py_ssize_t N = W.shape[0] if w_transposed else W.shape[1]
    if b is not None:
        f32(fn, "b", b, 1)
        _checks.same_dim(fn, "b", b, 0, N, "the output width")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"linear: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if accumulate and activation != "none":
        raise ValueError("linear: accumulate=True cannot be combined with an activation")
    if out is None:
        if accumulate:
            raise ValueError("linear: accumulate=True needs an out array to add into")
        out = np.empty((T, N), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, N))
        _checks.no_overlap(fn, "out", out, x=x, b=b)
        for a in keep:
            _checks.no_overlap(fn, "out", out, W=a)
    cdef int nt = _checks.threads(fn, threads)
    cdef float* ps = scratch_floats(fn, workspace, linear_scratch_size(T, K, N, w, nt), keep)
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef const float* pb = cptr(b)
    cdef bint acc = bool(accumulate)
    cdef int act = ACTIVATIONS[activation]
    if T and N:
        if K == 0:  # an empty sum: the output is the bias
            base = np.zeros(N, np.float32) if b is None else b
            res = np.broadcast_to(base, (T, N))
            if acc:
                out += res
            else:
                out[...] = res
            return out
        with nogil:
            linear(po, px, w, pb, T, K, N, act, acc, ps, nt)
    return out


def matvec_rows(x, W, *, w_transposed=False, threads=None):
    """x [B, K] @ W ([K, N], or [N, K] with w_transposed) -> float32 [B, N]
    through the batched decode step's matrix-vector path (gemv_team_rows):
    each block of W read once for every row of x, each row's outputs bitwise
    those of linear_forward on that row alone.  The kernels of a batch's
    step, reachable for tests and benchmarks (linear_forward sends 4 rows
    and more to the GEMM)."""
    fn = "matvec_rows"
    f32(fn, "x", x, 2)
    cdef Py_ssize_t B = x.shape[0], K = x.shape[1]
    cdef list keep = []
    cdef Wt w = weights_of(fn, "W", W, K, bool(w_transposed), keep)
    cdef Py_ssize_t N = W.shape[0] if w_transposed else W.shape[1]
    cdef int nt = _checks.threads(fn, threads)
    out = np.zeros((B, N), dtype=np.float32)
    if B == 0 or N == 0 or K == 0:
        return out
    cdef Py_ssize_t npart = 0 if w.t else B * gemv_partials_size(K, N)
    cdef Py_ssize_t per = gemv_acc_size(B, K)  # acc and, where the format prepares x, the prepared rows
    cdef float* ps = scratch_floats(fn, None, npart + nt * per, keep)
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef Py_ssize_t counter = 0
    cdef cyf_bar bar
    cdef Epilogue ep
    cdef Team team
    ep.bias, ep.act, ep.accumulate = NULL, ACT_NONE, False
    memset(&bar, 0, sizeof(bar))
    with nogil, parallel(num_threads=nt):
        team = team_of(threadid(), cyf_team_size(), &counter, &bar)
        gemv_team_rows(po, N, px, K, B, w, K, N, ep, ps, ps + npart + team.tid * per, team)
    return out


def add_into(out, x, threads=None):
    """out += x (the residual update), for float32 arrays of one shape."""
    f32("add", "out", out, -1, True)
    f32("add", "x", x, out.ndim)
    _checks.shape("add", "x", x, out.shape)
    _checks.no_overlap("add", "out", out, x=x)
    cdef int nt = _checks.threads("add", threads)
    cdef float* po = wptr(out)
    cdef const float* px = cptr(x)
    cdef Py_ssize_t n = out.size
    with nogil:
        add(po, px, n, nt)
    return out


def embedding(ids, wte, wpe, pos0=0, out=None, threads=None):
    """out[t] = wte[ids[t]] + wpe[pos0 + t] (wpe None: wte[ids[t]] alone).
    ids: 1-D integer array [T]."""
    fn = "embedding"
    if isinstance(wte, np.ndarray) or not hasattr(wte, "fmt"):
        f32(fn, "wte", wte, 2)
    cdef Py_ssize_t C = wte.shape[1]
    cdef list keep = []
    cdef Wt w = weights_of(fn, "wte", wte, C, True, keep)
    if wpe is not None:
        f32(fn, "wpe", wpe, 2)
        _checks.same_dim(fn, "wpe", wpe, 1, C, "wte.shape[1]")
    ids = _checks.token_ids(fn, "ids", ids, wte.shape[0], ndim=1)
    cdef Py_ssize_t T = ids.shape[0]
    pos0 = _checks.integer(fn, "pos0", pos0)
    if pos0 < 0:
        raise ValueError(f"embedding: pos0 must be >= 0, got {pos0}")
    if wpe is not None and pos0 + T > wpe.shape[0]:
        raise ValueError(f"embedding: positions {pos0}..{pos0 + T - 1} exceed the "
                         f"{wpe.shape[0]} rows of wpe")
    if out is None:
        out = np.empty((T, C), dtype=np.float32)
    else:
        f32(fn, "out", out, 2, True)
        _checks.shape(fn, "out", out, (T, C))
        _checks.no_overlap(fn, "out", out, wpe=wpe)
        for a in keep:
            _checks.no_overlap(fn, "out", out, wte=a)
    cdef int nt = _checks.threads(fn, threads)
    cdef const long long[::1] vid = ids
    cdef float* po = wptr(out)
    cdef const float* pp = cptr(wpe)
    cdef Py_ssize_t p0 = pos0
    if T:
        with nogil:
            embed(po, &vid[0], w, pp, T, C, p0, nt)
    return out


def stream_sum(x, threads=None):
    """Sum of a float32 array, each thread reading one contiguous part with
    the widest loads this kernel level has.  A probe, not a numeric kernel:
    the benchmark times it as the machine's streaming read bandwidth (the
    summation order is whatever is fastest)."""
    f32("stream_sum", "x", x, -1)
    cdef int nt = _checks.threads("stream_sum", threads)
    cdef const float* px = cptr(x)
    cdef Py_ssize_t n = x.size
    cdef Py_ssize_t per = (n + nt - 1) // nt
    cdef Py_ssize_t t
    cdef float total = 0.0
    if n:
        for t in prange(nt, nogil=True, num_threads=nt, schedule="static", chunksize=1):
            if t * per < n:
                total += cyf_stream_sum(px + t * per, n - t * per if n - t * per < per else per)
    return float(total)


def amx_tdpbf16ps_model(a, b, c):
    """One tdpbf16ps on amx.h's model of it: c [16, 16] float32 plus the
    products of a [16, 32] and b [16, 32] (bfloat16 codes, uint16; b's row k
    holds the pairs k of the 16 outputs, as the tile's strips do).  Returns
    the new c.  For tests: the model must give what the hardware gives."""
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    if a.shape != (16, 32) or b.shape != (16, 32) or c.shape != (16, 16):
        raise ValueError(f"amx_tdpbf16ps_model: needs a [16, 32], b [16, 32] and c [16, 16], "
                         f"got {a.shape}, {b.shape}, {c.shape}")
    if a.dtype != np.uint16 or b.dtype != np.uint16:
        raise TypeError(f"amx_tdpbf16ps_model: a and b are bfloat16 codes (uint16), got {a.dtype} and {b.dtype}")
    cdef const unsigned short[:, ::1] av = np.ascontiguousarray(a)
    cdef const unsigned short[:, ::1] bv = np.ascontiguousarray(b)
    cdef float[:, ::1] out = np.array(c, np.float32, order="C")
    cyf_amx_model_tdpbf16ps_16(&out[0, 0], &av[0, 0], &bv[0, 0])
    return np.asarray(out)


def integer_tiles_agree(features, reference=None, formats=("int8", "int4", "q8_0", "q4_0")):
    """True when the integer GEMM chosen by ``features`` (as for
    select_format_kernels) gives the bits of the one chosen by
    ``reference`` (default: the same features without AMX and the
    test-only variants) for a small
    prefill of each of ``formats``: 21 rows (a full AMX tile and a
    part-filled one), ragged outputs.  Leaves the CPU's default kernels
    selected."""
    for name, v in (("features", features), ("reference", reference)):
        if not isinstance(v, dict) and not (name == "reference" and v is None):
            raise TypeError(f"integer_tiles_agree: {name} must be a dict of feature name -> bool, "
                            f"got {type(v).__name__}")
    rng = np.random.default_rng(31)
    x = rng.standard_normal((21, 96)).astype(np.float32)
    x[3, :40] *= 1e-3
    mats = [_formats.quantize(rng.standard_normal((96, 45)).astype(np.float32), fmt) for fmt in formats]
    if reference is None:
        reference = dict(features, amx_int8=False, **dict.fromkeys(_TEST_ONLY, False))
    try:
        got = []
        for chosen in (features, reference):
            select_format_kernels(chosen)
            got.append([linear_forward(x, W, threads=1).view(np.uint32) for W in mats])
        return all(np.array_equal(a, b) for a, b in zip(*got))
    finally:
        select_format_kernels()


def bf16_tile_matches_reference(features):
    """True when the bfloat16 GEMM chosen by ``features`` (as for
    select_format_kernels) gives the bits of its numpy_ref reference
    (bf16amx_gemm for an AMX tile, bf16dp_gemm for AVX512-BF16) for a small
    prefill: 21 rows, K odd (a last step of fewer than 16 pairs), ragged
    outputs.  Leaves the CPU's default kernels selected."""
    from cyformer.backends import numpy_ref
    if not isinstance(features, dict):
        raise TypeError(f"bf16_tile_matches_reference: features must be a dict of feature name -> bool, "
                        f"got {type(features).__name__}")
    rng = np.random.default_rng(31)
    x = rng.standard_normal((21, 99)).astype(np.float32)
    W = _formats.quantize(rng.standard_normal((45, 99)).astype(np.float32), "bfloat16", transposed=True)
    try:
        used = select_format_kernels(features)
        if not (used["amx_bf16"] or used["amx_model"] or used["avx512_bf16"]):
            raise ValueError("bf16_tile_matches_reference: these features choose no bfloat16 GEMM")
        ref = numpy_ref.bf16amx_gemm if used["amx_bf16"] or used["amx_model"] else numpy_ref.bf16dp_gemm
        got = linear_forward(x, W, w_transposed=True, threads=1)
        return np.array_equal(got.view(np.uint32), ref(x, W.data, GEMV_ROWS, transposed=True).view(np.uint32))
    finally:
        select_format_kernels()


def _select_at_import():
    # This CPU's kernels, chosen once.  The AMX tiles are tested bit for bit
    # on their C model wherever AMX is missing; on a CPU that runs them, the
    # first import also checks the instructions (int8 against the VNNI tile,
    # bfloat16 against its reference), and leaves AMX unused (with a
    # warning) if they differ, rather than give other numbers.
    import warnings
    default = select_format_kernels()
    if not (default["amx_int8"] or default["amx_bf16"]):
        return
    plain = dict(_cpu_features(), **dict.fromkeys(_TEST_ONLY, False))
    if default["amx_int8"] and not integer_tiles_agree(dict(plain, amx_bf16=False)):
        _AMX_OFF.add("amx_int8")
        warnings.warn("cyformer: the AMX integer GEMM disagrees with the AVX512-VNNI one on this CPU; "
                      "prefill uses AVX512-VNNI", RuntimeWarning, stacklevel=2)
    if default["amx_bf16"] and not bf16_tile_matches_reference(dict(plain, amx_int8=False)):
        _AMX_OFF.add("amx_bf16")
        warnings.warn("cyformer: the AMX bfloat16 GEMM does not give its reference's bits on this CPU; "
                      "prefill uses AVX512-BF16", RuntimeWarning, stacklevel=2)
    if _AMX_OFF:  # the checks put the defaults back before AMX was turned off
        select_format_kernels()


_select_at_import()

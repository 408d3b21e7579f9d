# Linear algebra kernels: the products that hold almost all of the FLOPs.
#
# Layout conventions (row-major, float32):
#   x   [T, K]   activations, one row per position
#   W   [K, N]   weights as Hugging Face's Conv1D stores them (in, out);
#                with w_t=True, W is [N, K] (the tied unembedding, wte)
#   b   [N]      bias, may be NULL
#   out [T, N]
# In the float32 GEMM path every output element is one sequential k = 0..K-1
# chain of multiply-adds; the matrix-vector path, and the integer and
# bfloat16 GEMMs, sum fixed blocks of GEMV_ROWS rows and then the blocks in
# order.  How work is split between threads never
# changes a sum, so results are bitwise identical at any thread count.

# A weight matrix as the kernels read it (formats.h): data, scales, its row of
# the format table, orientation.  Stored [K, N] (in, out), or [N, K] when t
# (a row per output: the unembedding).  Callers ask W.f for the format's
# kernels and never test the format.
from .team cimport cyf_bar, cyf_bar_wait

cdef extern from "formats.h" nogil:
    # The integer GEMM of int8 / int4 weights (qgemm.h): panel packing and the register tile.
    ctypedef struct cyf_qgemm:
        void (*tile)(float* c, const signed char* q, const float* d, const int* bsum, int rows,
                     const unsigned char* strip, Py_ssize_t nblk, int bpp) noexcept nogil
        void (*pack_t)(unsigned char* panel, const Wt* W, Py_ssize_t K, Py_ssize_t N, Py_ssize_t n0,
                       Py_ssize_t pw) noexcept nogil  # W [N, K]: every format with one is rows_out
        int mr  # the most rows of x one tile call takes
    # The bfloat16 GEMM with AVX512-BF16 (bgemm.h): pair-interleaved strips, vdpbf16ps tile.
    ctypedef struct cyf_bgemm:
        void (*pack_t)(unsigned int* panel, const Wt* W, Py_ssize_t K, Py_ssize_t N, Py_ssize_t n0,
                       Py_ssize_t pw) noexcept nogil  # for W [N, K]
        void (*tile)(float* c, const unsigned int* xp, Py_ssize_t ldx, int rows, const unsigned int* strip,
                     Py_ssize_t np, int bpp) noexcept nogil
        int mr  # the most rows of x one tile call takes
    ctypedef struct cyf_format:
        const char* name
        const char* kernels
        bint out_scale   # scale[n] multiplies output n once it is finished
        bint in_place    # float32 rows the GEMM tile reads where they lie
        void (*gemv_block)(float* partial, const float* x, const Wt* W, Py_ssize_t k0, Py_ssize_t kb,
                           Py_ssize_t c0, Py_ssize_t cw, Py_ssize_t N, float* tmp) noexcept nogil
        void (*gemv_block_rows)(float* partial, Py_ssize_t ldp, const float* x, Py_ssize_t ldx, int nr,
                                const Wt* W, Py_ssize_t k0, Py_ssize_t kb, Py_ssize_t c0, Py_ssize_t cw) noexcept nogil
        void (*dot_t)(float* acc, const float* x, const Wt* W, Py_ssize_t a, Py_ssize_t nw, Py_ssize_t K) noexcept nogil
        void (*dot_t_rows)(float* acc, const float* x, Py_ssize_t ldx, int nr, const Wt* W, Py_ssize_t a,
                           Py_ssize_t nw, Py_ssize_t K) noexcept nogil
        void (*pack_run)(float* dst, const Wt* W, Py_ssize_t N, Py_ssize_t k, Py_ssize_t n, Py_ssize_t cnt) noexcept nogil
        void (*pack_t)(float* dst, Py_ssize_t ldd, const Wt* W, Py_ssize_t n, Py_ssize_t k0, Py_ssize_t kn,
                       Py_ssize_t K) noexcept nogil
        const cyf_qgemm* qgemm  # the integer GEMM (prefill), or NULL: float32 panels
        # x prepared once per product for W [N, K], or NULL: dot_t / dot_t_rows
        Py_ssize_t (*prep_bytes)(Py_ssize_t K) noexcept nogil
        void (*prep)(void* xp, const float* x, Py_ssize_t K) noexcept nogil
        void (*dot_tp_rows)(float* acc, const void* xp, Py_ssize_t ldxp, int nr, const Wt* W, Py_ssize_t a,
                            Py_ssize_t nw, Py_ssize_t K) noexcept nogil
        const cyf_bgemm* bgemm  # the bfloat16 GEMM (either orientation), or NULL
    Py_ssize_t CYF_PREP_FLOATS(Py_ssize_t K)
    ctypedef struct Wt "cyf_wt":
        const void* data
        const float* scale  # the format's scales, or NULL
        const cyf_format* f
        bint t
        Py_ssize_t ld       # between rows of the stored array, in its elements
    int CYF_NFORMATS
    int cyf_formats_select(int features)
    const cyf_format* cyf_format_at(int code)
    enum: CYF_QB, CYF_QMR_MAX, CYF_QNR, CYF_BMR_MAX, CYF_BNR, CYF_HAVE_VNNI_KERNELS, CYF_HAVE_AVXVNNI_KERNELS
    enum: CYF_HAVE_BF16DP_KERNELS
    Py_ssize_t cyf_bstrip_words(Py_ssize_t K)
    void cyf_bf16_pairs_of(const float* x, Py_ssize_t n, unsigned int* xp, Py_ssize_t npad)
    Py_ssize_t cyf_qstrip_bytes(Py_ssize_t K)
    void cyf_q8_row_gemm(const float* x, Py_ssize_t K, signed char* q, float* d, int* bsum)
    void cyf_dequant_row_t(float* out, const Wt* W, Py_ssize_t n, Py_ssize_t K)
    void cyf_amx_model_tdpbf16ps_16(float* c, const unsigned short* a, const unsigned short* b)

cdef inline Wt f32_weights(const float* W, bint t, Py_ssize_t ld) noexcept nogil:
    cdef Wt w
    w.data, w.scale, w.f, w.t, w.ld = W, NULL, cyf_format_at(0), t, ld
    return w

# The Wt of a float32 ndarray or a cyformer.formats.Packed matrix (checked:
# 2-D, C-contiguous, K inputs), keeping the arrays alive in `keep`.
cdef Wt weights_of(str fn, str name, object W, Py_ssize_t K, bint w_transposed, list keep) except *

# Floats of scratch memory that linear() needs for T rows of x [T, K] @ W
# (W [K, N], or [N, K] when W.t) on nthreads threads.
cdef Py_ssize_t gemv_acc_size(Py_ssize_t B, Py_ssize_t K) noexcept nogil
cdef Py_ssize_t linear_scratch_size(Py_ssize_t T, Py_ssize_t K, Py_ssize_t N, Wt W,
                                    int nthreads) noexcept nogil

cdef enum:
    # Fewer rows than this take the matrix-vector path: with so few rows,
    # packing W would cost as much as the product itself.
    MATVEC_ROWS = 4
    # Most columns per matrix-vector pass: their accumulators (16 KB) stay in
    # L1 while the rows of W stream past.  GPT-2's widest W [K, N] (3072
    # columns) then takes one pass, so a row block is read as one run.
    GEMV_COLS = 4096
    # Rows of W [K, N] per partial sum of the matrix-vector path: the unit of
    # work a thread streams (64 rows of 768-3072 floats: 192-768 KB).
    GEMV_ROWS = 64
    # The last GEMV_TAIL_BLOCKS row blocks are handed out as GEMV_TAIL_PIECES
    # column ranges each (the same sums, in smaller work items).
    GEMV_TAIL_BLOCKS = 2
    GEMV_TAIL_PIECES = 4
    # Outputs per work item when W is [N, K] (contiguous rows): at most 1.5 MB
    # of a d_model-768 unembedding, and at least GEMV_T_ITEMS items per
    # thread, in multiples of 16 outputs, so a 768-output block matrix (int8,
    # q8_0) is not split 512 / 256 between two threads.
    GEMV_T_ROWS = 512
    GEMV_T_ITEMS = 4
    # Several rows of x at once: columns per piece of a [K, N] block (64 x 512
    # floats, 128 KB, stay in L2 while every row reads them), and rows of an
    # [N, K] matrix per piece.
    GEMV_B_COLS = 512
    GEMV_B_ROWS_T = 64
    # From this many rows of x on, float32 weights go through the register
    # tiles (cyf_gemv_rows_b, cyf_dot_rows), which read each weight once for
    # every row and prefetch what comes next; one row at a time was slower
    # from 2 rows on (bench/results/2026-11-26-batch-step-prefetch-amd-epyc.md).
    # Same bits either way.
    GEMV_TILE_ROWS = 2

cdef float dot(const float* a, const float* b, Py_ssize_t n) noexcept nogil

# Memory the def wrappers reuse from call to call (see linalg.pyx).
cdef class Workspace:
    cdef dict arrays
    cdef float* scratch(self, Py_ssize_t n) except NULL

# The scratch pointer of n floats a wrapper works in: from `workspace` (a
# Workspace, or None for memory of this call's own, kept alive in `keep`).
cdef float* scratch_floats(str fn, object workspace, Py_ssize_t n, list keep) except NULL

# out = act(x @ W + b) or out += x @ W + b (accumulate), act an activations.Act
# (an activation and accumulate are never combined).  T < MATVEC_ROWS runs the bandwidth-bound
# matrix-vector path, otherwise the packed, register-blocked GEMM path.
cdef void linear(float* out, const float* x, Wt W, const float* b,
                 Py_ssize_t T, Py_ssize_t K, Py_ssize_t N,
                 int act, bint accumulate, float* scratch, int nthreads) noexcept nogil

# Outputs per thread when a team of nthreads splits N outputs: equal,
# rounded up to 16 so every range starts on a cache line.
cdef inline Py_ssize_t gemv_per_thread(Py_ssize_t N, int nthreads) noexcept nogil:
    cdef Py_ssize_t per = (N + nthreads - 1) // nthreads
    return (per + 15) // 16 * 16

# Floats of partial sums gemv_team needs (shared by the team); B rows of x
# need B times as many.
cdef Py_ssize_t gemv_partials_size(Py_ssize_t K, Py_ssize_t N) noexcept nogil

# What a product does with each finished sum s: out = act(s + bias), or
# out += s + bias when accumulating (an activation and accumulate are never
# combined).
cdef struct Epilogue:
    const float* bias  # [N] or NULL
    int act            # an activations.Act (never ACT_SWIGLU)
    bint accumulate

# A thread's place in the team of the enclosing parallel region.
cdef struct Team:
    int tid
    int size
    Py_ssize_t* counter  # work counter shared by the team
    cyf_bar* bar         # the team's barrier, shared (zeroed before the region)

# Build one by assigning the whole struct inside the parallel block (Cython
# makes a variable thread-private only when the variable itself is assigned;
# setting its fields would share one struct between the threads).
cdef inline Team team_of(int tid, int size, Py_ssize_t* counter, cyf_bar* bar) noexcept nogil:
    cdef Team t
    t.tid, t.size, t.counter, t.bar = tid, size, counter, bar
    return t

# Every thread of the team waits for the others.
cdef inline void team_barrier(Team t) noexcept nogil:
    cyf_bar_wait(t.bar, t.size)

# One row's matrix-vector product through the epilogue: x [K] @ W [K, N]
# (W [N, K] with w_t), shared by the team of the enclosing parallel region:
# every thread calls it with the same arguments, its own tid and acc
# (gemv_acc_size(1, K) floats).  team.counter is shared and 0 on entry and 0 again on
# return, so the next product may use it, and the call contains a barrier.  Pass another barrier before reading out or reusing
# partials.  Every output is the same sum whatever the team size, and the
# same as linear() gives for fewer than MATVEC_ROWS rows.
cdef void gemv_team(float* out, const float* x, Wt W, Py_ssize_t K, Py_ssize_t N,
                    Epilogue ep, float* partials, float* acc, Team team) noexcept nogil

# The same for B rows of x (ldx apart) into B rows of out (ldo apart), every
# block of W read from memory once for all of them: a batch's decode step.
# Row r's outputs are bitwise those of gemv_team on row r alone; acc is
# gemv_acc_size(B, K) floats.
cdef void gemv_team_rows(float* out, Py_ssize_t ldo, const float* x, Py_ssize_t ldx, Py_ssize_t B,
                         Wt W, Py_ssize_t K, Py_ssize_t N, Epilogue ep, float* partials, float* acc,
                         Team team) noexcept nogil

# out[i] += x[i]
cdef void add(float* out, const float* x, Py_ssize_t n, int nthreads) noexcept nogil

# row n of an [N, K] matrix in any format, as float32 (the embedding lookup)
cdef void dequant_row(float* out, Wt W, Py_ssize_t n, Py_ssize_t K) noexcept nogil

# out[t] = wte[ids[t]] + wpe[pos0 + t] (wpe NULL: wte[ids[t]]); ids must
# already be validated.
cdef void embed(float* out, const long long* ids, Wt wte, const float* wpe,
                Py_ssize_t T, Py_ssize_t C, Py_ssize_t pos0, int nthreads) noexcept nogil

"""One decode step, fused: a single new token through every layer in one
parallel region.

Generation feeds one token at a time.  Through the per-op kernels that is six
calls and five OpenMP fork/joins per layer, with Python in between while the
other threads wait.  Here the threads enter once per token and meet at a
barrier between stages.  Each stage calls the per-op kernels' own row
functions (ln_row, gemv_team, attend_one), so the logits are bitwise those
of the unfused path.

Stages per layer (C = d_model, F = d_mlp):
    x       = ln_1(resid)                 every thread, its own copy
    qkv     = x @ c_attn + b              gemv_team                      | barrier
    cache <- k, v;  z = attn(q)           heads split between threads    | barrier
    resid  += z @ attn.c_proj + b         gemv_team                      | barrier
    x       = ln_2(resid)                 every thread, its own copy
    hidden  = gelu(x @ c_fc + b)          gemv_team                      | barrier
    resid  += hidden @ mlp.c_proj + b     gemv_team                      | barrier
then x = ln_f(resid) and logits = x @ lm_head.T, the vocabulary split.
Layer norm of one row is ~1 us, so computing it on every thread is cheaper
than a barrier.
"""

from cython.parallel cimport parallel, threadid
from libc.stdlib cimport calloc, free

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport ACT_NONE, ACT_GELU_NEW, ACT_GELU_ERF
from .attention cimport append_kv_head, attend_one
from .linalg cimport GEMV_COLS, gemv_partials_size, gemv_team
from .norm cimport ln_row

from cyformer import _checks

cnp.import_array()

cdef extern from "team.h" nogil:
    int cyf_team_size()
    void cyf_barrier()

cdef enum:
    KEY_SLACK = 64  # attend_one's scratch runs up to one key strip past L

ACTIVATIONS = {"gelu_new": ACT_GELU_NEW, "gelu": ACT_GELU_ERF}
# The tensors of one layer, in the order DecodeStep takes them.
LAYER_TENSORS = ("ln_1.weight", "ln_1.bias", "c_attn.weight", "c_attn.bias",
                 "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                 "c_fc.weight", "c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")


cdef struct Layer:
    const float* ln1_g
    const float* ln1_b
    const float* attn_w
    const float* attn_b
    const float* attn_proj_w
    const float* attn_proj_b
    const float* ln2_g
    const float* ln2_b
    const float* fc_w
    const float* fc_b
    const float* mlp_proj_w
    const float* mlp_proj_b


cdef void _step(const Layer* layers, Py_ssize_t n_layer, const float* wte, const float* wpe,
                const float* lnf_g, const float* lnf_b, const float* lm_head,
                Py_ssize_t C, Py_ssize_t H, Py_ssize_t F, Py_ssize_t V, float eps, int act,
                Py_ssize_t token, float* k_cache, float* v_cache, Py_ssize_t past,
                Py_ssize_t cap, float* logits, float* shared, float* partials,
                float* private, Py_ssize_t private_size, int nthreads) noexcept nogil:
    cdef Py_ssize_t D = C // H
    cdef Py_ssize_t L = past + 1  # keys the new token sees, itself included
    cdef float* resid = shared
    cdef float* qkv = resid + C
    cdef float* z = qkv + 3 * C
    cdef float* hidden = z + C
    cdef Py_ssize_t l, h, c
    cdef int tid, team
    cdef const Layer* ly
    cdef float* x
    cdef float* acc
    cdef float* s
    cdef float* kl
    cdef float* vl
    # work counters: [0] for every W [K, N] product (each leaves it at 0),
    # [1] for the unembedding
    cdef Py_ssize_t counters[2]
    counters[0] = counters[1] = 0
    with parallel(num_threads=nthreads):
        tid = threadid()
        team = cyf_team_size()
        x = private + tid * private_size
        acc = x + C
        s = acc + GEMV_COLS
        if tid == 0:
            for c in range(C):
                resid[c] = wte[token * C + c] + wpe[past * C + c]
        cyf_barrier()
        for l in range(n_layer):
            ly = layers + l
            kl = k_cache + l * H * D * cap
            vl = v_cache + l * H * cap * D
            ln_row(x, resid, ly.ln1_g, ly.ln1_b, C, eps, NULL)
            gemv_team(qkv, x, ly.attn_w, ly.attn_b, C, 3 * C, False, ACT_NONE, False, partials, acc, &counters[0], tid, team)
            cyf_barrier()
            for h in range(tid * H // team, (tid + 1) * H // team):
                append_kv_head(qkv, kl, vl, past, 1, h, H, D, cap)
                attend_one(z + h * D, qkv + h * D, kl + h * D * cap, vl + h * cap * D, L, D, cap,
                           s, s + cap + KEY_SLACK, L, NULL, NULL, 0)
            cyf_barrier()
            gemv_team(resid, z, ly.attn_proj_w, ly.attn_proj_b, C, C, False, ACT_NONE, True, partials, acc,
                      &counters[0], tid, team)
            cyf_barrier()
            ln_row(x, resid, ly.ln2_g, ly.ln2_b, C, eps, NULL)
            gemv_team(hidden, x, ly.fc_w, ly.fc_b, C, F, False, act, False, partials, acc, &counters[0], tid, team)
            cyf_barrier()
            gemv_team(resid, hidden, ly.mlp_proj_w, ly.mlp_proj_b, F, C, False, ACT_NONE, True, partials,
                      acc, &counters[0], tid, team)
            cyf_barrier()
        ln_row(x, resid, lnf_g, lnf_b, C, eps, NULL)
        gemv_team(logits, x, lm_head, NULL, C, V, True, ACT_NONE, False, NULL, acc, &counters[1],
                  tid, team)


cdef class DecodeStep:
    """Logits [1, V] for one new token, given the key/value cache of the
    positions before it (which gets this token's keys and values).

    Built once per model from its weights:
        wte [V, C], wpe [P, C], layers: per layer the 12 arrays named by
        LAYER_TENSORS (Hugging Face Conv1D layout), ln_f gain and bias [C],
        lm_head [V, C]; n_head; layer-norm eps; activation "gelu_new" | "gelu".
    """

    cdef Layer* layers
    cdef list keep  # the arrays behind the pointers
    cdef Py_ssize_t n_layer, C, H, F, V, P
    cdef float eps
    cdef int act
    cdef const float* wte
    cdef const float* wpe
    cdef const float* lnf_g
    cdef const float* lnf_b
    cdef const float* lm_head

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, wte, wpe, layers, ln_f_weight, ln_f_bias, lm_head, n_head, eps,
                 activation="gelu_new"):
        fn = "DecodeStep"
        f32(fn, "wte", wte, 2)
        f32(fn, "wpe", wpe, 2)
        f32(fn, "lm_head", lm_head, 2)
        cdef Py_ssize_t V = wte.shape[0], C = wte.shape[1]
        _checks.same_dim(fn, "wpe", wpe, 1, C, "wte.shape[1]")
        _checks.shape(fn, "lm_head", lm_head, (V, C))
        f32(fn, "ln_f_weight", ln_f_weight, 1)
        f32(fn, "ln_f_bias", ln_f_bias, 1)
        _checks.shape(fn, "ln_f_weight", ln_f_weight, (C,))
        _checks.shape(fn, "ln_f_bias", ln_f_bias, (C,))
        n_head = _checks.integer(fn, "n_head", n_head)
        if n_head < 1 or C % n_head:
            raise ValueError(f"{fn}: n_head={n_head} must be >= 1 and divide d_model={C}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{fn}: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        layers = list(layers)
        if not layers:
            raise ValueError(f"{fn}: at least one layer is needed")
        cdef Py_ssize_t F = -1
        for i, ts in enumerate(layers):
            ts = tuple(ts)
            if len(ts) != len(LAYER_TENSORS):
                raise ValueError(f"{fn}: layer {i} must give {len(LAYER_TENSORS)} arrays {LAYER_TENSORS}")
            if F < 0:
                F = f32(fn, "c_fc.weight", ts[8], 2).shape[1]
            want = ((C,), (C,), (C, 3 * C), (3 * C,), (C, C), (C,), (C,), (C,), (C, F), (F,), (F, C), (C,))
            for name, arr, shape in zip(LAYER_TENSORS, ts, want):
                f32(fn, f"layers[{i}].{name}", arr, len(shape))
                _checks.shape(fn, f"layers[{i}].{name}", arr, shape)
            layers[i] = ts
        self.layers = <Layer*>calloc(len(layers), sizeof(Layer))
        if self.layers == NULL:
            raise MemoryError()
        cdef Layer* ly
        cdef Py_ssize_t j
        for j in range(len(layers)):
            ts = layers[j]
            ly = self.layers + j
            ly.ln1_g, ly.ln1_b = cptr(ts[0]), cptr(ts[1])
            ly.attn_w, ly.attn_b = cptr(ts[2]), cptr(ts[3])
            ly.attn_proj_w, ly.attn_proj_b = cptr(ts[4]), cptr(ts[5])
            ly.ln2_g, ly.ln2_b = cptr(ts[6]), cptr(ts[7])
            ly.fc_w, ly.fc_b = cptr(ts[8]), cptr(ts[9])
            ly.mlp_proj_w, ly.mlp_proj_b = cptr(ts[10]), cptr(ts[11])
        self.keep = [wte, wpe, ln_f_weight, ln_f_bias, lm_head, layers]
        self.n_layer, self.C, self.H, self.F, self.V, self.P = len(layers), C, n_head, F, V, wpe.shape[0]
        self.eps = float(eps)
        self.act = ACTIVATIONS[activation]
        self.wte, self.wpe, self.lm_head = cptr(wte), cptr(wpe), cptr(lm_head)
        self.lnf_g, self.lnf_b = cptr(ln_f_weight), cptr(ln_f_bias)

    def __call__(self, token, k_cache, v_cache, past, threads=None):
        """token: the new id; k_cache [L, H, D, cap], v_cache [L, H, cap, D]
        float32, filled at positions < past (this token goes to ``past``)."""
        fn = "decode step"
        token = _checks.integer(fn, "token", token)
        if not 0 <= token < self.V:
            raise ValueError(f"{fn}: token id {token} is outside the vocabulary [0, {self.V})")
        f32(fn, "k_cache", k_cache, 4, True)
        f32(fn, "v_cache", v_cache, 4, True)
        cdef Py_ssize_t D = self.C // self.H
        cdef Py_ssize_t cap = k_cache.shape[3]
        _checks.shape(fn, "k_cache", k_cache, (self.n_layer, self.H, D, cap))
        _checks.shape(fn, "v_cache", v_cache, (self.n_layer, self.H, cap, D))
        _checks.no_overlap(fn, "k_cache", k_cache, v_cache=v_cache)
        past = _checks.integer(fn, "past", past)
        if not 0 <= past < min(cap, self.P):
            raise ValueError(f"{fn}: past={past} is outside the cache ({cap} positions) "
                             f"or the context ({self.P} positions)")
        cdef int nt = _checks.threads(fn, threads)
        cdef Py_ssize_t C = self.C
        cdef Py_ssize_t private_size = C + GEMV_COLS + cap + KEY_SLACK + D + KEY_SLACK
        cdef Py_ssize_t npart = max(gemv_partials_size(C, 3 * C), gemv_partials_size(C, self.F),
                                    gemv_partials_size(self.F, C))
        work = np.empty(6 * C + self.F + npart + nt * private_size, dtype=np.float32)
        logits = np.empty((1, self.V), dtype=np.float32)
        cdef float* pw = wptr(work)
        cdef float* pl = wptr(logits)
        cdef float* pk = wptr(k_cache)
        cdef float* pv = wptr(v_cache)
        cdef Py_ssize_t tok = token, p = past
        with nogil:
            _step(self.layers, self.n_layer, self.wte, self.wpe, self.lnf_g, self.lnf_b,
                  self.lm_head, C, self.H, self.F, self.V, self.eps, self.act, tok, pk, pv, p,
                  cap, pl, pw, pw + 6 * C + self.F, pw + 6 * C + self.F + npart, private_size, nt)
        return logits

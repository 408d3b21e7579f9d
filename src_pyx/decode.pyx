"""One decode step, fused: a single new token through every layer in one
parallel region.

Generation feeds one token at a time.  Through the per-op kernels that is six
calls and five OpenMP fork/joins per layer, with Python in between while the
other threads wait.  Here the threads enter once per token and meet at a
barrier between stages.  Each stage calls the per-op kernels' own row
functions (norm_row, gemv_team, rope_head, attend_one), so the logits are
bitwise those of the unfused path.

Stages per layer (C = d_model, F = d_mlp, H query heads, G key/value heads):
    x       = norm_1(resid)               every thread, its own copy
    qkv     = x @ c_attn + b              gemv_team                      | barrier
    rotate q, k (rotary models); cache <- k, v       heads split         | barrier
    z       = attn(q)                     query heads split              | barrier
    resid  += z @ attn.c_proj + b         gemv_team                      | barrier
    x       = norm_2(resid)               every thread, its own copy
    hidden  = act(x @ c_fc + b)           gemv_team                      | barrier
              (SwiGLU: [gate | up] product, then silu(gate) * up split   | barrier)
    resid  += hidden @ mlp.c_proj + b     gemv_team                      | barrier
then x = norm_f(resid) and logits = x @ lm_head.T, the vocabulary split.
A norm of one row is ~1 us, so computing it on every thread is cheaper
than a barrier.
"""

from cython.parallel cimport parallel, threadid
from libc.stdlib cimport calloc, free

import numpy as np

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport ACT_NONE, ACT_SWIGLU
from .attention cimport append_kv_head, attend_one, attend_one_scratch_size, rope_head
from .linalg cimport (GEMV_COLS, Epilogue, Team, Wt, dequant_row, gemv_partials_size, gemv_team,
                      team_of, weights_of)
from .norm cimport norm_row
from .simd cimport cyf_swiglu_n
from .team cimport cyf_team_size, cyf_barrier

from .mlp import MLP_KINDS
from .norm import KINDS as NORM_KINDS
from cyformer import _checks

cnp.import_array()


cdef struct Layer:  # one block's weights (kernel layout; biases may be NULL)
    const float* ln1_g
    const float* ln1_b
    Wt attn_w
    const float* attn_b
    Wt attn_proj_w
    const float* attn_proj_b
    const float* ln2_g
    const float* ln2_b
    Wt fc_w
    const float* fc_b
    Wt mlp_proj_w
    const float* mlp_proj_b


cdef struct Net:  # everything a step reads besides the layers and the cache
    Py_ssize_t n_layer, C, H, G, D, F, V
    float eps
    int norm, act
    Wt wte                 # [V, C], rows read by the embedding lookup
    const float* wpe       # NULL for rotary models
    const float* rope_cos  # [P, D/2], NULL without rotary embeddings
    const float* rope_sin
    const float* lnf_g
    const float* lnf_b
    Wt lm_head             # [V, C]


cdef struct Scratch:  # memory of one step
    float* shared    # resid | qkv | z | hidden (| gate-up), read by every thread
    float* partials  # gemv_team's partial sums
    float* private   # private_size floats per thread
    Py_ssize_t private_size


cdef inline Epilogue _ep(const float* bias, int act, bint accumulate) noexcept nogil:
    cdef Epilogue e
    e.bias, e.act, e.accumulate = bias, act, accumulate
    return e


cdef void _step(const Net* net, const Layer* layers, Py_ssize_t token, float* k_cache,
                float* v_cache, Py_ssize_t past, Py_ssize_t cap, float* logits,
                Scratch mem, int nthreads) noexcept nogil:
    cdef Py_ssize_t C = net.C, H = net.H, G = net.G, D = net.D, F = net.F
    cdef Py_ssize_t NQ = (H + 2 * G) * D, half = D // 2
    cdef Py_ssize_t L = past + 1  # keys the new token sees, itself included
    cdef bint gated = net.act == ACT_SWIGLU
    cdef float* resid = mem.shared
    cdef float* qkv = resid + C
    cdef float* z = qkv + NQ
    cdef float* hidden = z + H * D
    cdef float* gate_up = hidden + F  # [2F], SwiGLU only
    cdef Py_ssize_t l, h, c, g, f0, f1
    cdef Team team
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
        team = team_of(threadid(), cyf_team_size(), &counters[0])
        x = mem.private + team.tid * mem.private_size
        acc = x + C
        s = acc + GEMV_COLS
        if team.tid == 0:
            dequant_row(resid, net.wte, token, C)
            if net.wpe != NULL:
                for c in range(C):
                    resid[c] = resid[c] + net.wpe[past * C + c]
        cyf_barrier()
        for l in range(net.n_layer):
            ly = layers + l
            kl = k_cache + l * G * D * cap
            vl = v_cache + l * G * cap * D
            norm_row(net.norm, x, resid, ly.ln1_g, ly.ln1_b, C, net.eps, NULL)
            gemv_team(qkv, x, ly.attn_w, C, NQ, _ep(ly.attn_b, ACT_NONE, False),
                      mem.partials, acc, team)
            cyf_barrier()
            # query and key heads (H + G of them) rotated, then cached
            if net.rope_cos != NULL:
                for h in range(team.tid * (H + G) // team.size, (team.tid + 1) * (H + G) // team.size):
                    rope_head(qkv + h * D, D, net.rope_cos + past * half, net.rope_sin + past * half)
                cyf_barrier()
            for g in range(team.tid * G // team.size, (team.tid + 1) * G // team.size):
                append_kv_head(qkv, kl, vl, past, 1, g, H, G, D, cap)
            cyf_barrier()
            for h in range(team.tid * H // team.size, (team.tid + 1) * H // team.size):
                g = h // (H // G)
                attend_one(z + h * D, qkv + h * D, kl + g * D * cap, vl + g * cap * D, L, D, cap,
                           s, L, NULL, NULL, 0)
            cyf_barrier()
            gemv_team(resid, z, ly.attn_proj_w, H * D, C, _ep(ly.attn_proj_b, ACT_NONE, True),
                      mem.partials, acc, team)
            cyf_barrier()
            norm_row(net.norm, x, resid, ly.ln2_g, ly.ln2_b, C, net.eps, NULL)
            if gated:
                gemv_team(gate_up, x, ly.fc_w, C, 2 * F, _ep(ly.fc_b, ACT_NONE, False),
                          mem.partials, acc, team)
                cyf_barrier()
                # in 16-float pieces, as gemv_team splits its outputs
                f0 = team.tid * F // team.size // 16 * 16
                f1 = F if team.tid == team.size - 1 else (team.tid + 1) * F // team.size // 16 * 16
                if f1 > f0:
                    cyf_swiglu_n(hidden + f0, gate_up + f0, gate_up + F + f0, f1 - f0)
            else:
                gemv_team(hidden, x, ly.fc_w, C, F, _ep(ly.fc_b, net.act, False),
                          mem.partials, acc, team)
            cyf_barrier()
            gemv_team(resid, hidden, ly.mlp_proj_w, F, C, _ep(ly.mlp_proj_b, ACT_NONE, True),
                      mem.partials, acc, team)
            cyf_barrier()
        norm_row(net.norm, x, resid, net.lnf_g, net.lnf_b, C, net.eps, NULL)
        team = team_of(team.tid, team.size, &counters[1])
        gemv_team(logits, x, net.lm_head, C, net.V, _ep(NULL, ACT_NONE, False), NULL, acc, team)


cdef class DecodeStep:
    """Logits [1, V] for one new token, given the key/value cache of the
    positions before it (which gets this token's keys and values).

    Built once per model: ``DecodeStep(cfg, weights, rope_cos, rope_sin)``
    with a cyformer Config and Weights (kernel layout, see cyformer.weights),
    and for rotary models the cos/sin tables [P, D/2].  Every array is
    checked here against the shapes cyformer.weights.layer_shapes(cfg) gives.
    """

    cdef Layer* layers
    cdef Net net
    cdef list keep  # the arrays behind the pointers
    cdef Py_ssize_t P

    def __cinit__(self):
        self.layers = NULL

    def __dealloc__(self):
        free(self.layers)

    def __init__(self, cfg, weights, rope_cos=None, rope_sin=None):
        from cyformer.weights import global_shapes, layer_shapes

        fn = "DecodeStep"
        if cfg.norm not in NORM_KINDS:
            raise ValueError(f"{fn}: norm must be one of {sorted(NORM_KINDS)}, got {cfg.norm!r}")
        if cfg.mlp_activation not in MLP_KINDS:
            raise ValueError(f"{fn}: activation must be one of {sorted(MLP_KINDS)}, "
                             f"got {cfg.mlp_activation!r}")
        cdef list keep = []

        def ptr_of(name, arr, shape):
            # the array's data pointer once it is float32 C-contiguous of `shape`
            # (None where the shape is None: a parameter this model lacks)
            if shape is None:
                if arr is not None:
                    raise ValueError(f"{fn}: {name} must be None for this model")
                return None
            if arr is None:
                raise ValueError(f"{fn}: {name} is missing")
            f32(fn, name, arr, len(shape))
            _checks.shape(fn, name, arr, shape)
            keep.append(arr)
            return arr

        glob = global_shapes(cfg)
        C = cfg.n_embd
        _checks.shape(fn, "wte", weights.wte, glob["wte"])
        _checks.shape(fn, "lm_head", weights.lm_head, glob["lm_head"])
        cdef Wt wte = weights_of(fn, "wte", weights.wte, C, True, keep)
        cdef Wt lm_head = weights_of(fn, "lm_head", weights.lm_head, C, True, keep)
        wpe = ptr_of("wpe", weights.wpe, glob["wpe"])
        lnf_g = ptr_of("ln_f.weight", weights.ln_f.weight, glob["ln_f.weight"])
        lnf_b = ptr_of("ln_f.bias", weights.ln_f.bias, glob["ln_f.bias"])
        half = cfg.d_head // 2
        if cfg.position == "rotary":
            cos = ptr_of("rope_cos", rope_cos, (cfg.n_positions, half))
            sin = ptr_of("rope_sin", rope_sin, (cfg.n_positions, half))
        else:
            cos = ptr_of("rope_cos", rope_cos, None)
            sin = ptr_of("rope_sin", rope_sin, None)
        blocks = list(weights.blocks)
        if len(blocks) != cfg.n_layer or not blocks:
            raise ValueError(f"{fn}: {len(blocks)} blocks for n_layer={cfg.n_layer}")
        shapes = layer_shapes(cfg)
        self.layers = <Layer*>calloc(len(blocks), sizeof(Layer))
        if self.layers == NULL:
            raise MemoryError()
        cdef Layer* ly
        cdef Py_ssize_t j

        def matrix(j, name):  # a weight matrix [K, N] in any format
            arr, shape = blocks[j].param(name), shapes[name]
            where = f"blocks[{j}].{name}"
            if arr is None:
                raise ValueError(f"{fn}: {where} is missing")
            _checks.shape(fn, where, arr, shape)
            return arr

        for j in range(len(blocks)):
            b = blocks[j]
            p = {name: ptr_of(f"blocks[{j}].{name}", b.param(name), shape)
                 for name, shape in shapes.items() if not name.endswith(".weight") or name.startswith("ln_")}
            ly = self.layers + j
            ly.ln1_g, ly.ln1_b = cptr(p["ln_1.weight"]), cptr(p["ln_1.bias"])
            ly.attn_w = weights_of(fn, f"blocks[{j}].attn.c_attn.weight",
                                   matrix(j, "attn.c_attn.weight"), C, False, keep)
            ly.attn_b = cptr(p["attn.c_attn.bias"])
            ly.attn_proj_w = weights_of(fn, f"blocks[{j}].attn.c_proj.weight",
                                        matrix(j, "attn.c_proj.weight"), cfg.n_head * cfg.d_head, False, keep)
            ly.attn_proj_b = cptr(p["attn.c_proj.bias"])
            ly.ln2_g, ly.ln2_b = cptr(p["ln_2.weight"]), cptr(p["ln_2.bias"])
            ly.fc_w = weights_of(fn, f"blocks[{j}].mlp.c_fc.weight", matrix(j, "mlp.c_fc.weight"), C, False, keep)
            ly.fc_b = cptr(p["mlp.c_fc.bias"])
            ly.mlp_proj_w = weights_of(fn, f"blocks[{j}].mlp.c_proj.weight",
                                       matrix(j, "mlp.c_proj.weight"), cfg.d_mlp, False, keep)
            ly.mlp_proj_b = cptr(p["mlp.c_proj.bias"])
        self.keep = keep
        self.P = cfg.n_positions
        cdef Net* net = &self.net
        net.n_layer, net.C, net.H, net.G = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head
        net.D, net.F, net.V = cfg.d_head, cfg.d_mlp, cfg.vocab_size
        net.eps = float(cfg.norm_eps)
        net.norm = NORM_KINDS[cfg.norm]
        net.act = MLP_KINDS[cfg.mlp_activation]
        net.wte, net.wpe, net.lm_head = wte, cptr(wpe), lm_head
        net.rope_cos, net.rope_sin = cptr(cos), cptr(sin)
        net.lnf_g, net.lnf_b = cptr(lnf_g), cptr(lnf_b)

    def __call__(self, token, k_cache, v_cache, past, threads=None):
        """token: the new id; k_cache [L, G, D, cap], v_cache [L, G, cap, D]
        float32, filled at positions < past (this token goes to ``past``)."""
        fn = "decode step"
        cdef Net* net = &self.net
        token = _checks.integer(fn, "token", token)
        if not 0 <= token < net.V:
            raise ValueError(f"{fn}: token id {token} is outside the vocabulary [0, {net.V})")
        f32(fn, "k_cache", k_cache, 4, True)
        f32(fn, "v_cache", v_cache, 4, True)
        cdef Py_ssize_t C = net.C, D = net.D, F = net.F
        cdef Py_ssize_t cap = k_cache.shape[3]
        _checks.shape(fn, "k_cache", k_cache, (net.n_layer, net.G, D, cap))
        _checks.shape(fn, "v_cache", v_cache, (net.n_layer, net.G, cap, D))
        _checks.no_overlap(fn, "k_cache", k_cache, v_cache=v_cache)
        past = _checks.integer(fn, "past", past)
        if not 0 <= past < min(cap, self.P):
            raise ValueError(f"{fn}: past={past} is outside the cache ({cap} positions) "
                             f"or the context ({self.P} positions)")
        cdef int nt = _checks.threads(fn, threads)
        cdef Py_ssize_t NQ = (net.H + 2 * net.G) * D
        cdef Py_ssize_t nshared = C + NQ + net.H * D + 3 * F
        cdef Py_ssize_t private_size = C + GEMV_COLS + attend_one_scratch_size(cap, D)
        cdef Py_ssize_t n_in = 2 * F if net.act == ACT_SWIGLU else F
        cdef Py_ssize_t npart = max(gemv_partials_size(C, NQ), gemv_partials_size(C, n_in),
                                    gemv_partials_size(F, C), gemv_partials_size(net.H * D, C))
        work = np.empty(nshared + npart + nt * private_size, dtype=np.float32)
        logits = np.empty((1, net.V), dtype=np.float32)
        cdef float* pw = wptr(work)
        cdef Scratch mem
        mem.shared = pw
        mem.partials = pw + nshared
        mem.private = pw + nshared + npart
        mem.private_size = private_size
        cdef float* pl = wptr(logits)
        cdef float* pk = wptr(k_cache)
        cdef float* pv = wptr(v_cache)
        cdef Py_ssize_t tok = token, p = past
        with nogil:
            _step(net, self.layers, tok, pk, pv, p, cap, pl, mem, nt)
        return logits

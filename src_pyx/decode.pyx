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
from libc.string cimport memset

import numpy as np

from .linalg import aligned_empty

cimport numpy as cnp

from ._util cimport cptr, f32, wptr
from .activations cimport ACT_NONE, ACT_SWIGLU
from .attention cimport append_kv_head, attend_one, attend_one_scratch_size, rope_head
from .linalg cimport (GEMV_COLS, Epilogue, Team, Wt, dequant_row, gemv_acc_size, gemv_partials_size,
                      gemv_team_rows, team_barrier, team_of, weights_of)
from .norm cimport norm_row
from .simd cimport cyf_swiglu_n
from .team cimport cyf_bar, cyf_team_size

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
    const float* lm_b      # [V] unembedding bias (weight processing), or NULL


cdef struct Scratch:  # memory of one step
    float* shared    # resid | qkv | z | hidden | gate-up, B rows each, read by every thread
    float* partials  # gemv_team's partial sums
    float* private   # private_size floats per thread
    Py_ssize_t private_size


cdef struct Seq:  # one sequence of a batch: its new token and its cache
    Py_ssize_t token
    Py_ssize_t past  # positions already cached; the token goes here
    Py_ssize_t cap
    float* k         # [L, G, D, cap]
    float* v         # [L, G, cap, D]


cdef inline Py_ssize_t _lines16(Py_ssize_t n) noexcept nogil:
    return (n + 15) // 16 * 16  # floats of whole 64-byte lines


cdef inline Epilogue _ep(const float* bias, int act, bint accumulate) noexcept nogil:
    cdef Epilogue e
    e.bias, e.act, e.accumulate = bias, act, accumulate
    return e


cdef inline void _norms(int kind, float* x, const float* resid, const float* g, const float* b,
                        Py_ssize_t B, Py_ssize_t C, float eps) noexcept nogil:
    cdef Py_ssize_t r
    for r in range(B):
        norm_row(kind, x + r * C, resid + r * C, g, b, C, eps, NULL)


cdef void _step(const Net* net, const Layer* layers, const Seq* seqs, Py_ssize_t B, float* logits,
                Scratch mem, int nthreads) noexcept nogil:
    # B sequences, each at its own position with its own cache: every weight
    # matrix is read once for all of them (gemv_team_rows); attention runs
    # per sequence and head.  Row r's arithmetic is that of a one-sequence
    # step, so a batch gives each sequence bitwise its own logits.
    cdef Py_ssize_t C = net.C, H = net.H, G = net.G, D = net.D, F = net.F
    cdef Py_ssize_t NQ = (H + 2 * G) * D, half = D // 2
    cdef bint gated = net.act == ACT_SWIGLU
    cdef float* resid = mem.shared          # [B, C]
    cdef float* qkv = resid + B * C         # [B, NQ]
    cdef float* z = qkv + B * NQ            # [B, H D]
    cdef float* hidden = z + B * H * D      # [B, F]
    cdef float* gate_up = hidden + B * F    # [B, 2F], SwiGLU only
    cdef Py_ssize_t l, h, c, g, f0, f1, i, r, p
    cdef Team team
    cdef const Layer* ly
    cdef const Seq* sq
    cdef float* x
    cdef float* acc
    cdef float* s
    cdef float* kl
    cdef float* vl
    cdef float* row
    # work counters: [0] for every W [K, N] product (each leaves it at 0),
    # [1] for the unembedding
    cdef Py_ssize_t counters[2]
    cdef cyf_bar bar
    counters[0] = counters[1] = 0
    memset(&bar, 0, sizeof(bar))
    with parallel(num_threads=nthreads):
        team = team_of(threadid(), cyf_team_size(), &counters[0], &bar)
        x = mem.private + team.tid * mem.private_size   # [B, C], this thread's copy
        acc = x + _lines16(B * C)
        s = acc + GEMV_COLS
        if team.tid == 0:
            for r in range(B):
                dequant_row(resid + r * C, net.wte, seqs[r].token, C)
                if net.wpe != NULL:
                    for c in range(C):
                        resid[r * C + c] = resid[r * C + c] + net.wpe[seqs[r].past * C + c]
        team_barrier(team)
        for l in range(net.n_layer):
            ly = layers + l
            _norms(net.norm, x, resid, ly.ln1_g, ly.ln1_b, B, C, net.eps)
            gemv_team_rows(qkv, NQ, x, C, B, ly.attn_w, C, NQ, _ep(ly.attn_b, ACT_NONE, False),
                           mem.partials, acc, team)
            team_barrier(team)
            # query and key heads (H + G per sequence) rotated, then cached
            if net.rope_cos != NULL:
                for i in range(team.tid * B * (H + G) // team.size, (team.tid + 1) * B * (H + G) // team.size):
                    r = i // (H + G)
                    p = seqs[r].past
                    rope_head(qkv + r * NQ + (i % (H + G)) * D, D, net.rope_cos + p * half,
                              net.rope_sin + p * half)
                team_barrier(team)
            for i in range(team.tid * B * G // team.size, (team.tid + 1) * B * G // team.size):
                sq = seqs + i // G
                append_kv_head(qkv + (i // G) * NQ, sq.k + l * G * D * sq.cap, sq.v + l * G * sq.cap * D,
                               sq.past, 1, i % G, H, G, D, sq.cap)
            team_barrier(team)
            for i in range(team.tid * B * H // team.size, (team.tid + 1) * B * H // team.size):
                r = i // H
                h = i % H
                g = h // (H // G)
                sq = seqs + r
                kl = sq.k + l * G * D * sq.cap
                vl = sq.v + l * G * sq.cap * D
                attend_one(z + r * H * D + h * D, qkv + r * NQ + h * D, kl + g * D * sq.cap,
                           vl + g * sq.cap * D, sq.past + 1, D, sq.cap, s, sq.past + 1, NULL, NULL, 0)
            team_barrier(team)
            gemv_team_rows(resid, C, z, H * D, B, ly.attn_proj_w, H * D, C,
                           _ep(ly.attn_proj_b, ACT_NONE, True), mem.partials, acc, team)
            team_barrier(team)
            _norms(net.norm, x, resid, ly.ln2_g, ly.ln2_b, B, C, net.eps)
            if gated:
                gemv_team_rows(gate_up, 2 * F, x, C, B, ly.fc_w, C, 2 * F, _ep(ly.fc_b, ACT_NONE, False),
                               mem.partials, acc, team)
                team_barrier(team)
                # in 16-float pieces, as gemv_team splits its outputs
                f0 = team.tid * F // team.size // 16 * 16
                f1 = F if team.tid == team.size - 1 else (team.tid + 1) * F // team.size // 16 * 16
                if f1 > f0:
                    for r in range(B):
                        row = gate_up + r * 2 * F
                        cyf_swiglu_n(hidden + r * F + f0, row + f0, row + F + f0, f1 - f0)
            else:
                gemv_team_rows(hidden, F, x, C, B, ly.fc_w, C, F, _ep(ly.fc_b, net.act, False),
                               mem.partials, acc, team)
            team_barrier(team)
            gemv_team_rows(resid, C, hidden, F, B, ly.mlp_proj_w, F, C, _ep(ly.mlp_proj_b, ACT_NONE, True),
                           mem.partials, acc, team)
            team_barrier(team)
        _norms(net.norm, x, resid, net.lnf_g, net.lnf_b, B, C, net.eps)
        team = team_of(team.tid, team.size, &counters[1], &bar)
        gemv_team_rows(logits, net.V, x, C, B, net.lm_head, C, net.V, _ep(net.lm_b, ACT_NONE, False), NULL,
                       acc, team)


cdef class DecodeStep:
    """Logits [1, V] for one new token, given the key/value cache of the
    positions before it (which gets this token's keys and values).

    Built once per model: ``DecodeStep(cfg, weights, rope_cos, rope_sin)``
    with a cyformer Config and Weights (kernel layout, see cyformer.weights),
    and for rotary models the cos/sin tables [R, D/2] of the first R <=
    n_positions positions (``set_rope`` gives it longer ones; a position past
    R is refused).  Every array is checked here against the shapes
    cyformer.weights.layer_shapes(cfg) gives.
    """

    cdef Layer* layers
    cdef Net net
    cdef list keep  # the arrays behind the pointers
    cdef Py_ssize_t P
    cdef Py_ssize_t rope_rows  # positions the rotary tables cover (P without rotary embeddings)
    cdef tuple rope_keep

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
        lm_b = getattr(weights, "lm_head_bias", None)  # only after weight processing
        if lm_b is not None:
            lm_b = ptr_of("lm_head_bias", lm_b, (cfg.vocab_size,))
        half = cfg.d_head // 2
        if cfg.position == "rotary":
            rows = getattr(rope_cos, "shape", (cfg.n_positions,))[0]
            if not 1 <= rows <= cfg.n_positions:
                raise ValueError(f"{fn}: rope_cos has {rows} rows; expected 1 .. n_positions={cfg.n_positions}")
            cos = ptr_of("rope_cos", rope_cos, (rows, half))
            sin = ptr_of("rope_sin", rope_sin, (rows, half))
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
        self.rope_rows = cos.shape[0] if cos is not None else self.P
        self.rope_keep = (cos, sin)
        cdef Net* net = &self.net
        net.n_layer, net.C, net.H, net.G = cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head
        net.D, net.F, net.V = cfg.d_head, cfg.d_mlp, cfg.vocab_size
        net.eps = float(cfg.norm_eps)
        net.norm = NORM_KINDS[cfg.norm]
        net.act = MLP_KINDS[cfg.mlp_activation]
        net.wte, net.wpe, net.lm_head = wte, cptr(wpe), lm_head
        net.rope_cos, net.rope_sin = cptr(cos), cptr(sin)
        net.lnf_g, net.lnf_b = cptr(lnf_g), cptr(lnf_b)
        net.lm_b = cptr(lm_b)

    def set_rope(self, rope_cos, rope_sin):
        """Use longer rotary tables [R, D/2] (R at least the current rows, at
        most n_positions).  The caller keeps the earlier tables alive: a step
        running in another thread may still read them."""
        fn = "DecodeStep.set_rope"
        if self.net.rope_cos == NULL:
            raise ValueError(f"{fn}: this model has no rotary embeddings")
        half = self.net.D // 2
        f32(fn, "rope_cos", rope_cos, 2)
        f32(fn, "rope_sin", rope_sin, 2)
        rows = rope_cos.shape[0]
        if not self.rope_rows <= rows <= self.P:
            raise ValueError(f"{fn}: {rows} rows; expected {self.rope_rows} .. n_positions={self.P}")
        _checks.shape(fn, "rope_cos", rope_cos, (rows, half))
        _checks.shape(fn, "rope_sin", rope_sin, (rows, half))
        self.rope_keep = (rope_cos, rope_sin)
        self.net.rope_cos, self.net.rope_sin = cptr(rope_cos), cptr(rope_sin)
        self.rope_rows = rows

    def __call__(self, token, k_cache, v_cache, past, threads=None):
        """token: the new id; k_cache [L, G, D, cap], v_cache [L, G, cap, D]
        float32, filled at positions < past (this token goes to ``past``).
        Returns logits [1, V]."""
        return self.batch([token], [k_cache], [v_cache], [past], threads, "decode step")

    def batch(self, tokens, k_caches, v_caches, pasts, threads=None, fn="decode batch"):
        """One step of B sequences at once: tokens [B] (one new id each),
        their caches (lists of B arrays as for a single step) and positions
        pasts [B].  Each weight matrix is read once for the whole batch;
        returns logits [B, V], row r bitwise that of a one-sequence step."""
        cdef Net* net = &self.net
        tokens, k_caches, v_caches, pasts = list(tokens), list(k_caches), list(v_caches), list(pasts)
        cdef Py_ssize_t B = len(tokens)
        if B < 1 or not (len(k_caches) == len(v_caches) == len(pasts) == B):
            raise ValueError(f"{fn}: tokens, k_caches, v_caches and pasts must be as long as each other "
                             f"and non-empty, got {len(tokens)}, {len(k_caches)}, {len(v_caches)}, {len(pasts)}")
        cdef Py_ssize_t C = net.C, D = net.D, F = net.F
        cdef Seq* seqs = <Seq*>calloc(B, sizeof(Seq))
        if seqs == NULL:
            raise MemoryError()
        cdef Py_ssize_t r, maxcap = 0
        try:
            for r in range(B):
                token = _checks.integer(fn, "token", tokens[r])
                if not 0 <= token < net.V:
                    raise ValueError(f"{fn}: token id {token} is outside the vocabulary [0, {net.V})")
                k_cache, v_cache = k_caches[r], v_caches[r]
                f32(fn, "k_cache", k_cache, 4, True)
                f32(fn, "v_cache", v_cache, 4, True)
                cap = k_cache.shape[3]
                _checks.shape(fn, "k_cache", k_cache, (net.n_layer, net.G, D, cap))
                _checks.shape(fn, "v_cache", v_cache, (net.n_layer, net.G, cap, D))
                _checks.no_overlap(fn, "k_cache", k_cache, v_cache=v_cache)
                for q in range(r):
                    _checks.no_overlap(fn, f"k_caches[{r}]", k_cache, **{f"the cache of sequence {q}": k_caches[q]})
                    _checks.no_overlap(fn, f"v_caches[{r}]", v_cache, **{f"the cache of sequence {q}": v_caches[q]})
                past = _checks.integer(fn, "past", pasts[r])
                if not 0 <= past < min(cap, self.P):
                    raise ValueError(f"{fn}: past={past} is outside the cache ({cap} positions) "
                                     f"or the context ({self.P} positions)")
                if past >= self.rope_rows:
                    raise ValueError(f"{fn}: past={past} is beyond the rotary tables' {self.rope_rows} "
                                     "positions (set_rope gives longer ones)")
                seqs[r].token, seqs[r].past, seqs[r].cap = token, past, cap
                seqs[r].k, seqs[r].v = wptr(k_cache), wptr(v_cache)
                maxcap = max(maxcap, cap)
            nt = _checks.threads(fn, threads)
            NQ = (net.H + 2 * net.G) * D
            # Every region starts on a 64-byte line: the kernels' 64-byte
            # loads of x (prepared or not) split across two lines otherwise,
            # and where a fresh array happened to land moved a one-thread
            # int4 decode by a third (GPT-2 small, 113-125 against 150-190
            # tokens/s, set by the size of the environment).
            nshared = _lines16(B * (C + NQ + net.H * D + 3 * F))
            # acc, then either attention's scratch or x as an [N, K] matrix's format prepares it
            private_size = _lines16(_lines16(B * C) + max(GEMV_COLS + attend_one_scratch_size(maxcap, D),
                                                gemv_acc_size(B, max(C, F, net.H * D))))
            n_in = 2 * F if net.act == ACT_SWIGLU else F
            npart = _lines16(B * max(gemv_partials_size(C, NQ), gemv_partials_size(C, n_in),
                                     gemv_partials_size(F, C), gemv_partials_size(net.H * D, C)))
            work = aligned_empty(nshared + npart + nt * private_size)
            logits = np.empty((B, net.V), dtype=np.float32)
            self._run(seqs, B, work, nshared, npart, private_size, logits, nt)
        finally:
            free(seqs)
        return logits

    cdef void _run(self, Seq* seqs, Py_ssize_t B, object work, Py_ssize_t nshared, Py_ssize_t npart,
                   Py_ssize_t private_size, object logits, int nt) except *:
        cdef float* pw = wptr(work)
        cdef Scratch mem
        mem.shared = pw
        mem.partials = pw + nshared
        mem.private = pw + nshared + npart
        mem.private_size = private_size
        cdef float* pl = wptr(logits)
        with nogil:
            _step(&self.net, self.layers, seqs, B, pl, mem, nt)

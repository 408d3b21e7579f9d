"""The "numpy" backend: the forward pass as vectorised NumPy, attention in einsum form.

A reference to check the kernels against, not a fast path: pure functions,
bottom-up, every line with its shape.  The model reads

    resid  = wte[ids] (+ wpe[positions])           # embed
    for each block:
        resid = resid + attn(norm_1(resid))        # the only step where positions mix
        resid = resid + mlp(norm_2(resid))         # one position at a time
    logits = norm_f(resid) @ lm_head.T             # unembed

with the family's choices (cyformer.arch): layer norm or RMSNorm, learned or
rotary positions, GELU or SwiGLU, G key/value heads shared by groups of the H
query heads.

Letters: T new positions (queries), S = past + T visible positions (keys),
C = d_model, H query heads, G key/value heads, D = d_head, F = d_mlp,
V vocabulary.  In the einsum strings s/q/k are positions, d is d_model, n is
the query head, g the key/value head, h is d_head.

Everything is float32, like the compiled kernels: NumPy keeps float32 inputs
in float32 (it accumulates pairwise or in BLAS, so the last bits differ from
the kernels', well inside the tests' 1e-4).  ``threads`` is stored for
symmetry with the other backends; NumPy's BLAS picks its own thread count.
"""

import math

import numpy as np

from .. import rope
from ..config import Config
from . import forward_each
from ..weights import BlockWeights, NormWeights, Weights, dequantized

F32 = np.float32

# erf has no NumPy ufunc (and scipy is no dependency): math.erf per element,
# in float64, then rounded to float32.  Only the "gelu" (erf) checkpoints use it.
_erf = np.frompyfunc(math.erf, 1, 1)


# -- int8 dot products (the kernels' integer decode path, bit for bit) ----

Q8_BLOCK = 32  # inputs per activation scale (formats.h's CYF_QB)


def q8_activations(x):
    """x [K] float32 -> (codes int32 [nblk, 32], scales float32 [nblk]): per
    block of 32 inputs d = max|x| / 127 and q = rint(x * (1 / d)) (ties to
    even) in [-127, 127], in float32; d = 0 gives q = 0, a block with a NaN
    or infinity gets d = NaN and q = 0.  The last block is zero-padded.
    Where 1 / d would overflow (d < 2^-120), x and d are scaled by 2^64
    first: the same codes wherever 1 / d is finite, sensible ones where not."""
    x = np.asarray(x, dtype=F32)
    K = x.shape[0]
    nblk = -(-K // Q8_BLOCK)
    xb = np.zeros((nblk, Q8_BLOCK), F32)
    xb.reshape(-1)[:K] = x
    a = np.abs(xb)
    finite = np.isfinite(xb).all(axis=1)
    amax = np.where(finite, a.max(axis=1, initial=F32(0)), F32(0)).astype(F32)
    d = (amax / F32(127)).astype(F32)
    up = np.where(d < F32(2.0 ** -120), F32(2.0 ** 64), F32(1)).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d != 0, F32(1) / np.where(d != 0, d * up, F32(1)), F32(0)).astype(F32)
        xs = (np.where(finite[:, None], xb, F32(0)) * up[:, None]).astype(F32)
        q = np.clip(np.rint(xs * inv[:, None]), -127, 127)
    d = np.where(finite, d, F32(np.nan)).astype(F32)
    return q.astype(np.int32), d


def _fma(a, b, c):
    """a * b + c (float32 arrays) rounded once to float32: the product of a
    float32 and an integer below 2^24 is exact in float64, so one rounding."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def q8_matvec(x, codes, scale, rows_per_block):
    """The int8 decode product x [K] @ W [K, N] (codes int8 [K, N], scale
    float32 [N] per output), as the kernels sum it: rows in blocks of
    rows_per_block (linalg's GEMV_ROWS), within a block each activation
    block's integer sums times its d added with one rounding, the blocks'
    partial sums added in order, then times the scale."""
    q, d = q8_activations(x)
    K, N = codes.shape
    total = None
    for k0 in range(0, K, rows_per_block):
        part = np.zeros(N, F32)
        for b0 in range(k0, min(K, k0 + rows_per_block), Q8_BLOCK):
            b1 = min(K, b0 + Q8_BLOCK, k0 + rows_per_block)
            isum = q.reshape(-1)[b0:b1].astype(np.int64) @ codes[b0:b1].astype(np.int64)
            part = _fma(np.full(N, d[b0 // Q8_BLOCK], F32), isum.astype(F32), part)
        total = part if total is None else (total + part).astype(F32)
    if total is None:
        total = np.zeros(N, F32)
    return (total * scale).astype(F32)


def q4_matvec(x, data, scale, rows_per_block):
    """The int4 decode product x [K] @ W [K, N] (data: uint8 [ceil(K/2), N]
    nibble pairs, q + 8, low nibble the even input; scale float32 [K/32, N]),
    as the kernels sum it: grouped_matvec's order."""
    K = x.shape[0]
    codes = np.empty((data.shape[0] * 2, data.shape[1]), np.int64)
    codes[0::2] = (data & 15).astype(np.int64) - 8
    codes[1::2] = (data >> 4).astype(np.int64) - 8
    return grouped_matvec(x, codes[:K], scale, rows_per_block)


def grouped_matvec(x, codes, scale, rows_per_block):
    """x [K] @ W [K, N], W given as integer codes [K, N] and float32 scales
    per block of 32 inputs and output [K/32, N], as the integer kernels sum
    it (int4's decode and the integer GEMM's grouped tile): q8_matvec's
    order, each block's integer sums times float32(d_b * scale[b]) added
    with one rounding."""
    q, d = q8_activations(x)
    K, N = codes.shape
    total = None
    for k0 in range(0, K, rows_per_block):
        part = np.zeros(N, F32)
        for b0 in range(k0, min(K, k0 + rows_per_block), Q8_BLOCK):
            b1 = min(K, b0 + Q8_BLOCK, k0 + rows_per_block)
            isum = q.reshape(-1)[b0:b1].astype(np.int64) @ codes[b0:b1].astype(np.int64)
            t = (d[b0 // Q8_BLOCK] * scale[b0 // Q8_BLOCK]).astype(F32)
            part = _fma(t, isum.astype(F32), part)
        total = part if total is None else (total + part).astype(F32)
    return np.zeros(N, F32) if total is None else total


def records_gemm_row(x, fmt, records, rows_per_block):
    """A row of the integer GEMM (prefill) of a q8_0 or q4_0 matrix (GGUF
    records, uint8 [N, K/32 * record]): the records' codes and fp16 scales
    through grouped_matvec, as int4's grouped tile sums them.  (Decode's
    q8_0_matvec / q4_0_matvec sum the same terms in another order.)"""
    from ..formats import q4_0_split, q8_0_split

    codes, dw = (q8_0_split if fmt == "q8_0" else q4_0_split)(records)   # [N, nblk, 32], [N, nblk]
    N = codes.shape[0]
    return grouped_matvec(x, codes.reshape(N, -1).T.astype(np.int64), dw.T.astype(F32), rows_per_block)


def q8_matvec_t(x, codes, scale):
    """The int8 product x [K] @ W.T for W [N, K] stored a row per output
    (codes int8 [N, K], scale float32 [N]: the unembedding), as the kernels
    sum it: inputs in pairs of blocks (64), each output in 16 float lanes;
    lane l of pair p adds the integer sum of inputs 64p + 4l .. + 3 times
    its block's d with one rounding, pair after pair; then the lanes are
    added in a fixed tree (l + 8, + 4, + 2, + 1), then times the scale."""
    q, d = q8_activations(x)
    N, K = codes.shape
    npair = -(-K // (2 * Q8_BLOCK))
    qp = np.zeros(npair * 2 * Q8_BLOCK, np.int64)                    # [64 npair]
    qp[:q.size] = q.reshape(-1)
    wp = np.zeros((N, npair * 2 * Q8_BLOCK), np.int64)               # [N, 64 npair]
    wp[:, :K] = codes
    lanes = (wp * qp).reshape(N, npair, 16, 4).sum(axis=-1)          # [N, npair, 16] exact
    dp = np.zeros(2 * npair, F32)
    dp[:d.size] = d
    dl = np.repeat(dp.reshape(npair, 2), 8, axis=1)                 # [npair, 16] each lane's d
    acc = np.zeros((N, 16), F32)
    for p in range(npair):
        acc = _fma(np.broadcast_to(dl[p], (N, 16)), lanes[:, p].astype(F32), acc)
    for half in (8, 4, 2, 1):                                         # the fixed tree
        acc = (acc[:, :half] + acc[:, half:2 * half]).astype(F32)
    return (acc[:, 0] * scale).astype(F32)


def q4_matvec_t(x, data, scale):
    """The int4 product x [K] @ W.T for W [N, K] stored a row per output
    (data uint8 [N, ceil(K/2)]: byte p holds input 2p in its low nibble and
    2p + 1 in its high one, nibble = q + 8; scale float32 [N, ceil(K/32)] per
    group of 32 inputs), as the kernels sum it: inputs in chunks of 128 (4
    groups), each output in 16 float lanes; lane l of chunk c adds the
    integer sum of inputs 128c + 8l .. + 7 times float32(d * scale) of its
    group 4c + l // 4 with one rounding, chunk after chunk (a group past K
    adds 0 * 0); then the lanes are added in q8_matvec_t's tree."""
    q, d = q8_activations(x)
    N = data.shape[0]
    K = x.shape[0]
    nch = -(-K // 128)
    qp = np.zeros(nch * 128, np.int64)                                # [128 nch]
    qp[:K] = q.reshape(-1)[:K]
    wp = np.zeros((N, nch * 128), np.int64)                           # [N, 128 nch] codes
    codes = np.empty((N, 2 * data.shape[1]), np.int64)
    codes[:, 0::2] = (data & 15).astype(np.int64) - 8
    codes[:, 1::2] = (data >> 4).astype(np.int64) - 8
    wp[:, :K] = codes[:, :K]
    lanes = (wp * qp).reshape(N, nch, 16, 8).sum(axis=-1)             # [N, nch, 16] exact
    ng = d.size
    dp = np.zeros(4 * nch, F32)
    dp[:ng] = d
    sp = np.zeros((N, 4 * nch), F32)
    sp[:, :ng] = scale
    t = np.repeat((dp * sp).astype(F32).reshape(N, nch, 4), 4, axis=2)  # [N, nch, 16] each lane's d * s
    acc = np.zeros((N, 16), F32)
    for c in range(nch):
        acc = _fma(t[:, c], lanes[:, c].astype(F32), acc)
    for half in (8, 4, 2, 1):                                         # the fixed tree
        acc = (acc[:, :half] + acc[:, half:2 * half]).astype(F32)
    return acc[:, 0].copy()


# -- bfloat16 dot products (AVX512-BF16's vdpbf16ps, bit for bit) ----------

def _bf16_daz(h):
    """bf16 codes (uint16) -> float64 values, denormals read as (signed) zero."""
    h = np.asarray(h, np.uint16)
    h = np.where((h & 0x7F80) == 0, h & 0x8000, h).astype(np.uint32) << 16
    return h.view(np.float32).astype(np.float64)


def _ftz(a):
    """float32 denormals flushed to zero of the same sign."""
    u = a.view(np.uint32)
    return np.where((u & 0x7F800000) == 0, u & 0x80000000, u).astype(np.uint32).view(F32)


def _dp_fma(acc, x, w):
    """One of vdpbf16ps's two steps: acc + x * w rounded once to float32
    (nearest even), the result flushed to zero if denormal; x, w float64
    from _bf16_daz.  The product of two bf16 values is exact in float64, and
    the float64 sum, rounded again to float32, is the correctly rounded one
    (53 >= 2 * 24 + 2 bits: double rounding is harmless)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _ftz((acc.astype(np.float64) + x * w).astype(F32))


def bf16dp_matvec(x, codes, rows_per_block):
    """The bfloat16 decode product x [K] @ W [K, N] (codes uint16 [K, N]) as
    the AVX512-BF16 kernel sums it: x rounded to bf16 (formats._bfloat16),
    rows in blocks of rows_per_block (linalg's GEMV_ROWS); within a block,
    per output, the row pairs (2p, 2p + 1) from zero, each pair as vdpbf16ps
    does it: the odd row's product added first, then the even one's (an odd
    block ends with a zero pair); the blocks' partial sums added in order."""
    return bf16dp_gemm(np.asarray(x, F32)[None], codes, rows_per_block)[0]


def bf16dp_gemm(x, codes, rows_per_block, transposed=False):
    """The bfloat16 prefill product x [T, K] @ W as the AVX512-BF16 GEMM
    (bgemm.h) sums it: every row as bf16dp_matvec, W [K, N] (codes uint16
    [K, N]), or, with transposed, W [N, K] stored a row per output (codes
    [N, K]) summed in the same order as its [K, N] transpose.  Returns
    float32 [T, N]."""
    xb, wb = _bf16_operands(x, codes, transposed)
    zero, pad = np.zeros((x.shape[0], 1)), np.zeros(wb.shape[1])

    def run(k0, k1):
        part = np.zeros((xb.shape[0], wb.shape[1]), F32)
        for k in range(k0, k1, 2):
            part = _dp_fma(part, xb[:, k + 1:k + 2], wb[k + 1]) if k + 1 < k1 else _dp_fma(part, zero, pad)
            part = _dp_fma(part, xb[:, k:k + 1], wb[k])
        return part

    return _bf16_runs(xb, wb, rows_per_block, run)


def bf16amx_gemm(x, codes, rows_per_block, transposed=False):
    """The bfloat16 prefill product as the AMX tile (btile_amx.h) sums it:
    bf16dp_gemm's runs, each from zero in steps of up to 16 pairs (one
    tdpbf16ps each).  A step adds even + odd to the run's sum, each addition
    rounded once, where even and odd are float32 chains from zero over the
    step's pairs in order, one taking the pairs' even products, the other
    their odd ones: what a Sapphire Rapids-class Xeon does, bit for bit (amx.h's model)."""
    xb, wb = _bf16_operands(x, codes, transposed)
    zero, pad = np.zeros((x.shape[0], 1)), np.zeros(wb.shape[1])

    def run(k0, k1):
        part = np.zeros((xb.shape[0], wb.shape[1]), F32)
        for s0 in range(k0, k1, 32):
            chains = [np.zeros_like(part), np.zeros_like(part)]
            for k in range(s0, min(k1 + k1 % 2, s0 + 32)):  # an odd K's last pair ends with 0 * 0
                chains[k % 2] = _dp_fma(chains[k % 2], *((xb[:, k:k + 1], wb[k]) if k < k1 else (zero, pad)))
            step = _ftz((chains[0].astype(np.float64) + chains[1]).astype(F32))
            part = _ftz((part.astype(np.float64) + step).astype(F32))
        return part

    return _bf16_runs(xb, wb, rows_per_block, run)


def _bf16_operands(x, codes, transposed):
    """x [T, K] rounded to bf16 and W as [K, N], both float64 with bf16
    denormals read as zero."""
    from ..formats import _bfloat16
    codes = codes.T if transposed else codes
    return _bf16_daz(_bfloat16(np.asarray(x, F32))), _bf16_daz(codes)


def _bf16_runs(xb, wb, rows_per_block, run):
    """The runs of rows_per_block inputs, each summed by run(k0, k1) from
    zero, added in order."""
    K, N = wb.shape
    total = None
    for k0 in range(0, K, rows_per_block):
        part = run(k0, min(K, k0 + rows_per_block))
        total = part if total is None else (total + part).astype(F32)
    return np.zeros((xb.shape[0], N), F32) if total is None else total


def bf16dp_dot_t(x, codes):
    """The bfloat16 unembedding product W [N, K] @ x [K] (codes uint16 [N, K])
    as the AVX512-BF16 kernel sums it: 16 lanes per output, lane i taking
    inputs 32t + 2i + 1 then 32t + 2i for t = 0, 1, .. (vdpbf16ps; zeros past
    K), then the lanes added in cyf_tree16's pairwise tree."""
    from ..formats import _bfloat16
    N, K = codes.shape
    Kp = -(-K // 32) * 32
    xb = np.zeros(Kp)
    xb[:K] = _bf16_daz(_bfloat16(np.asarray(x, F32)))
    wb = np.zeros((N, Kp))
    wb[:, :K] = _bf16_daz(codes)
    xb, wb = xb.reshape(-1, 16, 2), wb.reshape(N, -1, 16, 2)
    lanes = np.zeros((N, 16), F32)
    for t in range(Kp // 32):
        lanes = _dp_fma(lanes, xb[t, :, 1], wb[:, t, :, 1])
        lanes = _dp_fma(lanes, xb[t, :, 0], wb[:, t, :, 0])
    for w in (8, 4, 2, 1):
        lanes[:, :w] = lanes[:, :w] + lanes[:, w:2 * w]
    return lanes[:, 0].copy()


def q8_0_matvec(x, records):
    """The q8_0 decode product: x [K] against W [N, K] given as GGUF Q8_0
    records (uint8 [N, K/32 * 34]), as the kernels sum it (llama.cpp's
    vec_dot_q8_0_q8_0 in a fixed order): per output, block b's term
    isum_b * float32(d_w * d_x), isum_b the exact sum of its 32 code
    products, added with one rounding into lane b % 16 of 16 partial sums
    (from zero, blocks in order, missing blocks of the last 16 as 0 * 0),
    then the lanes added as halves, 16 -> 8 -> 4 -> 2 -> 1.  Returns float32 [N]."""
    from ..formats import q8_0_split

    return _block_matvec(x, *q8_0_split(records))


def q4_0_matvec(x, records):
    """The q4_0 decode product: x [K] against W [N, K] given as GGUF Q4_0
    records (uint8 [N, K/32 * 18]), summed as q8_0_matvec with codes
    nibble - 8.  Returns float32 [N]."""
    from ..formats import q4_0_split

    return _block_matvec(x, *q4_0_split(records))


def _block_matvec(x, codes, dw):
    # codes int8 [N, nblk, 32], dw float32 [N, nblk]: see q8_0_matvec
    q, dx = q8_activations(x)                                      # [nblk, 32], [nblk]
    N, nblk = dw.shape
    isum = np.einsum("nbi,bi->nb", codes.astype(np.int64), q[:nblk].astype(np.int64))  # [N, nblk], exact
    npad = -(-nblk // 16) * 16
    t, i = np.zeros((N, npad), F32), np.zeros((N, npad), F32)
    t[:, :nblk] = (dw * dx[:nblk]).astype(F32)
    i[:, :nblk] = isum
    s = np.zeros((N, 16), F32)
    for c in range(0, npad, 16):
        s = _fma(t[:, c:c + 16], i[:, c:c + 16], s)
    while s.shape[1] > 1:
        h = s.shape[1] // 2
        s = (s[:, :h] + s[:, h:]).astype(F32)
    return s[:, 0]


# -- building blocks ------------------------------------------------------

def layer_norm(x, w: NormWeights, eps):
    """x [T, C] -> [T, C]: zero mean, unit variance per position, then gain and bias."""
    mean = x.mean(axis=-1, keepdims=True)                      # [T, 1]
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)       # [T, 1] biased variance, as in PyTorch
    return (x - mean) / np.sqrt(var + F32(eps)) * w.weight + w.bias  # [T, C]


def rms_norm(x, w: NormWeights, eps):
    """x [T, C] -> [T, C]: unit root-mean-square per position, then gain (no centring, no bias)."""
    ms = (x * x).mean(axis=-1, keepdims=True)                  # [T, 1]
    return x / np.sqrt(ms + F32(eps)) * w.weight               # [T, C]


NORMS = {"layer_norm": layer_norm, "rms_norm": rms_norm}


def gelu_new(x):
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F32(0.5) * x * (F32(1) + np.tanh(F32(math.sqrt(2 / math.pi)) * (x + F32(0.044715) * x ** 3)))


def gelu_erf(x):
    """The exact GELU: 0.5 x (1 + erf(x / sqrt(2)))."""
    erf = _erf(x.astype(np.float64) / math.sqrt(2)).astype(F32)  # [..] same shape as x
    return F32(0.5) * x * (F32(1) + erf)


def silu(x):
    """x * sigmoid(x), SwiGLU's gate activation."""
    return x / (F32(1) + np.exp(-x))


GELU = {"gelu_new": gelu_new, "gelu": gelu_erf}


def softmax(x):
    """Softmax over the last axis; subtracting the max keeps exp() from overflowing
    (masked entries are -inf and come out exactly 0)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))  # [..., S]
    return e / e.sum(axis=-1, keepdims=True)        # [..., S]


# -- the cache ------------------------------------------------------------

class NumpyCache:
    """Keys and values of earlier positions for one sequence.

    k[layer], v[layer]  [G, capacity, D], positions 0 .. length-1 filled.
    """

    def __init__(self, cfg: Config, capacity):
        cap = int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"NumpyCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        G, D = cfg.n_kv_head, cfg.d_head
        self.capacity = cap
        self.k = [np.zeros((G, cap, D), dtype=F32) for _ in range(cfg.n_layer)]  # L x [G, cap, D]
        self.v = [np.zeros((G, cap, D), dtype=F32) for _ in range(cfg.n_layer)]  # L x [G, cap, D]
        self.length = 0


# -- the layers -----------------------------------------------------------

def _bias(b, *shape):
    """A bias reshaped, or a scalar 0 for a family without it."""
    return F32(0) if b is None else b.reshape(shape)


class Attention:
    """Causal self-attention with per-head weight views.

    c_attn's weight [C, (H + 2G) D] holds q | k | v side by side: H query
    heads, then G key and G value heads, each D columns; slicing and
    reshaping gives W_Q [H, C, D] and W_K, W_V [G, C, D] as views of the
    loaded array (nothing copied).  c_proj's weight [H D, C] reads the
    heads' concatenated outputs, so its rows split into W_O [H, D, C].
    Query head n reads key/value head n // (H / G).
    """

    def __init__(self, w: BlockWeights, cfg: Config, rope_tables):
        C, H, G, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.d_head
        W = w.c_attn.weight
        self.W_Q = W[:, :H * D].reshape(C, H, D).transpose(1, 0, 2)             # [H, C, D] view
        self.W_K = W[:, H * D:(H + G) * D].reshape(C, G, D).transpose(1, 0, 2)  # [G, C, D] view
        self.W_V = W[:, (H + G) * D:].reshape(C, G, D).transpose(1, 0, 2)       # [G, C, D] view
        b = w.c_attn.bias
        self.b_Q = _bias(None if b is None else b[:H * D], H, 1, D)             # [H, 1, D] or 0
        self.b_K = _bias(None if b is None else b[H * D:(H + G) * D], G, 1, D)  # [G, 1, D] or 0
        self.b_V = _bias(None if b is None else b[(H + G) * D:], G, 1, D)
        self.W_O = w.attn_c_proj.weight.reshape(H, D, C)                       # [H, D, C] view
        self.b_O = _bias(w.attn_c_proj.bias, C)                                 # [C] or 0
        self.group = H // G
        self.rope = rope_tables
        self.scale = F32(1 / math.sqrt(D))

    def __call__(self, x, k_cache, v_cache, past):
        """x [T, C] (after norm_1) for positions past .. past+T-1 -> update [T, C].

        Writes this step's keys and values into k_cache, v_cache [G, cap, D]."""
        T = x.shape[0]
        S = past + T
        # 1. project the stream into each head's query, key and value spaces
        q = np.einsum("s d, n d h -> n s h", x, self.W_Q) + self.b_Q    # [H, T, D]
        k = np.einsum("s d, g d h -> g s h", x, self.W_K) + self.b_K    # [G, T, D]
        v = np.einsum("s d, g d h -> g s h", x, self.W_V) + self.b_V    # [G, T, D]
        if self.rope is not None:  # 2. turn queries and keys by their positions
            cos, sin = rope.rows(self.rope, past, S)                     # [T, D/2]
            q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        k_cache[:, past:S] = k                                          # [G, S, D] filled
        v_cache[:, past:S] = v
        # each query head reads the key/value head of its group
        keys = np.repeat(k_cache[:, :S], self.group, axis=0)            # [H, S, D]
        values = np.repeat(v_cache[:, :S], self.group, axis=0)          # [H, S, D]
        # 3. QK: how much each query position attends to each key position
        scores = np.einsum("n q h, n k h -> n q k", q, keys) * self.scale  # [H, T, S]
        # 4. causal mask: query i sits at position past + i and sees keys 0 .. past + i
        future = np.triu(np.ones((T, S), dtype=bool), k=past + 1)      # [T, S] True = masked
        scores = np.where(future, F32(-np.inf), scores)                # [H, T, S]
        pattern = softmax(scores)                                      # [H, T, S] rows sum to 1
        # 5. OV: mix the visible values, then write each head back to the stream
        z = np.einsum("n q k, n k h -> q n h", pattern, values)        # [T, H, D]
        return np.einsum("q n h, n h d -> q d", z, self.W_O) + self.b_O  # [T, C] summed over heads


class MLP:
    """F neurons: read from the stream (c_fc), activate, write back (c_proj).
    SwiGLU has two reads per neuron, a gate and an "up" value:
    silu(x @ W_gate) * (x @ W_up)."""

    def __init__(self, w: BlockWeights, cfg: Config):
        self.c_fc, self.c_proj, self.gated = w.c_fc, w.mlp_c_proj, cfg.gated
        self.act = None if cfg.gated else GELU[cfg.gelu]

    def __call__(self, x):
        """x [T, C] (after norm_2) -> update [T, C]."""
        pre = x @ self.c_fc.weight + _bias(self.c_fc.bias, -1)  # [T, F] or [T, 2F]: gate | up
        if self.gated:
            gate, up = np.split(pre, 2, axis=-1)                 # [T, F] each
            h = silu(gate) * up                                  # [T, F]
        else:
            h = self.act(pre)                                    # [T, F]
        return h @ self.c_proj.weight + _bias(self.c_proj.bias, -1)  # [T, C]


class Block:
    """One residual block: resid += attn(norm_1(resid)); resid += mlp(norm_2(resid))."""

    def __init__(self, w: BlockWeights, cfg: Config, rope_tables):
        self.w, self.eps, self.norm = w, cfg.norm_eps, NORMS[cfg.norm]
        self.attn = Attention(w, cfg, rope_tables)
        self.mlp = MLP(w, cfg)

    def __call__(self, resid, k_cache, v_cache, past):
        """resid [T, C] -> the next resid [T, C]."""
        resid = resid + self.attn(self.norm(resid, self.w.ln_1, self.eps), k_cache, v_cache, past)  # [T, C]
        return resid + self.mlp(self.norm(resid, self.w.ln_2, self.eps))  # [T, C]


class NumpyBackend:
    """The forward pass over loaded weights, one sequence at a time."""

    name = "numpy"
    supports_hooks = False
    exact_chunk = None  # not checked to be bitwise the same however a prefill is split

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights = dequantized(weights)  # smaller formats are widened: a reference
        self.threads = threads  # unused: NumPy's BLAS threads itself
        tables = rope.inv_freq(cfg) if cfg.position == "rotary" else None  # rows made per call
        self.blocks = [Block(w, cfg, tables) for w in weights.blocks]

    def new_cache(self, capacity, reuse=False):
        """reuse: part of the shared interface; a new cache every time here."""
        return NumpyCache(self.config, capacity)

    def forward_batch(self, batch):
        """Logits [B, T, V] of B fresh sequences (batch [B, T]), one at a time."""
        return forward_each(self, batch)

    def step_batch(self, tokens, caches):
        """One decode step for B sequences: tokens [B], caches B caches, each
        advanced by one; returns logits [B, V] (a loop of run)."""
        return np.concatenate([self.run(np.array([t], dtype=np.int64), kv) for t, kv in zip(tokens, caches)])

    def run(self, ids, kv: NumpyCache, last_only=False):
        """Feed token ids [T] after the kv.length cached positions; returns
        float32 logits [T, V] (or [1, V] with last_only)."""
        w, cfg = self.weights, self.config
        ids = np.asarray(ids, dtype=np.int64)                  # [T]
        past, T = kv.length, len(ids)
        if past + T > kv.capacity:
            raise ValueError(f"run: {past} cached + {T} new positions exceed the cache's "
                             f"capacity of {kv.capacity}")
        resid = w.wte[ids]                                     # [T, C]
        if w.wpe is not None:
            resid = resid + w.wpe[past:past + T]               # [T, C] learned positions
        for i, block in enumerate(self.blocks):
            resid = block(resid, kv.k[i], kv.v[i], past)       # [T, C]
        kv.length = past + T
        if last_only:
            resid = resid[-1:]                                 # [1, C]
        x = NORMS[cfg.norm](resid, w.ln_f, cfg.norm_eps)       # [T, C]
        logits = x @ w.lm_head.T                               # [T, V]
        if w.lm_head_bias is not None:
            logits = logits + w.lm_head_bias
        return np.ascontiguousarray(logits, dtype=F32)

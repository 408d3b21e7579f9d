"""The model's parts as objects to read: heads, neurons, the unembedding.

Every matrix here is a read-only view into the loaded weights, never a copy,
sliced the way the math reads.  cyformer stores every family's weights as
[in, out] (GPT-2's Conv1D layout; cyformer.arch), so with C = d_model,
D = d_head, H query heads, G key/value heads, F = d_mlp:

    c_attn.weight [C, (H+2G) D] = [W_Q | W_K | W_V]: query head h in columns
        h*D:(h+1)*D, key/value head g in the K and V blocks; query head h
        reads key/value head h // (H/G) (grouped-query attention when G < H)
    attn c_proj.weight [H D, C] = W_O stacked over heads: head h reads rows h*D:(h+1)*D
    c_fc.weight [C, F]: neuron n reads the residual stream along column n
        (SwiGLU: [C, 2F], the gate reads in columns :F, the up reads in F:)
    mlp c_proj.weight [F, C]: neuron n writes row n into the residual stream
    lm_head [V, C]: row t is token t's logit direction

Biases a family does not have are None.

A head's two circuits (Elhage et al., "A Mathematical Framework for
Transformer Circuits", 2021) are C x C matrices of rank at most D:
    QK = W_Q @ W_K.T   score(query x, key y) = x @ QK @ y / sqrt(D)  (biases aside)
    OV = W_V @ W_O     what the head writes for a source position x: x @ OV
Both are kept as their two thin factors (FactoredMatrix).
"""

import numpy as np


def _view(a):
    """A read-only view of a (slice of a) weight array (None stays None)."""
    if a is None:
        return None
    v = a.view()
    v.flags.writeable = False
    return v


class FactoredMatrix:
    """M = A @ B held as A [m, k] and B [k, n] with k small (a head's d_head).

    ``@`` with vectors and matrices never builds M; ``full()`` does.  The
    spectrum comes from k x k problems: with A = Qa Ra and B.T = Qb Rb
    (thin QR), M = Qa (Ra Rb.T) Qb.T, so M's singular values are those of
    Ra Rb.T; M's nonzero eigenvalues (m = n) are those of B @ A.
    """

    # let ``ndarray @ FactoredMatrix`` reach __rmatmul__ instead of NumPy
    __array_ufunc__ = None

    def __init__(self, A, B):
        A, B = np.asarray(A), np.asarray(B)
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != B.shape[0]:
            raise ValueError(f"FactoredMatrix: need A [m, k] and B [k, n], got {A.shape} and {B.shape}")
        self.A, self.B = A, B

    @property
    def shape(self):
        return (self.A.shape[0], self.B.shape[1])

    @property
    def rank_bound(self):
        """k: no product of these factors has a larger rank."""
        return self.A.shape[1]

    def __repr__(self):
        m, n = self.shape
        return f"<FactoredMatrix {m}x{n}, factors {self.A.shape} @ {self.B.shape}>"

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):  # (A B)(C D) = A (B C D): stays thin
            return FactoredMatrix(self.A, (self.B.astype(np.float64) @ other.A) @ other.B)
        return self.A @ (self.B @ np.asarray(other))

    def __rmatmul__(self, other):
        return (np.asarray(other) @ self.A) @ self.B

    @property
    def T(self):
        return FactoredMatrix(self.B.T, self.A.T)

    def full(self):
        """The m x n matrix itself (float64)."""
        return self.A.astype(np.float64) @ self.B.astype(np.float64)

    def singular_values(self):
        """All min(m, n) singular values, descending (float64; beyond k they are 0)."""
        ra = np.linalg.qr(self.A.astype(np.float64), mode="r")
        rb = np.linalg.qr(self.B.T.astype(np.float64), mode="r")
        s = np.linalg.svd(ra @ rb.T, compute_uv=False)
        out = np.zeros(min(self.shape))
        out[:len(s)] = s[:len(out)]
        return out

    def eigenvalues(self):
        """All m eigenvalues of a square M, largest magnitude first (complex;
        beyond k they are 0)."""
        m, n = self.shape
        if m != n:
            raise ValueError(f"eigenvalues: the matrix is {m}x{n}, not square")
        small = np.linalg.eigvals(self.B.astype(np.float64) @ self.A.astype(np.float64))
        small = small[np.argsort(-np.abs(small), kind="stable")]
        out = np.zeros(m, dtype=np.complex128)
        out[:len(small)] = small[:m]
        return out


class Indexed(tuple):
    """A tuple of parts whose out-of-range index names the part and the valid range."""

    def __new__(cls, items, what):
        self = super().__new__(cls, items)
        self.what = what
        return self

    def __getitem__(self, i):
        try:
            return super().__getitem__(i)
        except IndexError:
            raise IndexError(f"{self.what} index {i} out of range: there are {len(self)} "
                             f"(0..{len(self) - 1})") from None


class Head:
    """One attention head of one layer; W_* and b_* are read-only weight views.

    W_Q, W_K, W_V [C, D]; b_Q, b_K, b_V [D] (None where the model has no
    such bias); W_O [D, C].  Under grouped-query attention W_K and W_V are
    those of the key/value head this head shares (``kv_index``).  (The
    output bias b_O belongs to the layer, shared by all heads:
    ``Attention.b_O``.)
    """

    def __init__(self, layer, index, block_weights, cfg):
        self.layer, self.index = layer, index
        H, G, D = cfg.n_head, cfg.n_kv_head, cfg.d_head
        self.kv_index = g = index // (H // G)
        W, b = block_weights.c_attn.weight, block_weights.c_attn.bias
        cols = [slice(index * D, (index + 1) * D), slice((H + g) * D, (H + g + 1) * D),
                slice((H + G + g) * D, (H + G + g + 1) * D)]
        self.W_Q, self.W_K, self.W_V = (_view(W[:, c]) for c in cols)
        self.b_Q, self.b_K, self.b_V = ((None, None, None) if b is None else (_view(b[c]) for c in cols))
        self.W_O = _view(block_weights.attn_c_proj.weight[index * D:(index + 1) * D])

    def __repr__(self):
        return f"<Head L{self.layer}H{self.index}: d_model {self.W_Q.shape[0]}, d_head {self.W_Q.shape[1]}>"

    def qk_circuit(self):
        """W_Q @ W_K.T [C, C] in factored form: x_query @ QK @ x_key is the
        (unscaled, bias-free) attention score between two residual vectors."""
        return FactoredMatrix(self.W_Q, self.W_K.T)

    def ov_circuit(self):
        """W_V @ W_O [C, C] in factored form: x @ OV is what the head writes
        for a source position x it fully attends to (bias-free)."""
        return FactoredMatrix(self.W_V, self.W_O)


class Attention:
    """A layer's attention: ``heads[h]``, and the shared output bias ``b_O`` [C]."""

    def __init__(self, layer, block_weights, cfg):
        self.heads = Indexed((Head(layer, h, block_weights, cfg) for h in range(cfg.n_head)),
                             f"layer {layer}: head")
        self.b_O = _view(block_weights.attn_c_proj.bias)


class Neuron:
    """One MLP neuron: it reads the residual stream along ``read`` [C], adds
    ``bias`` (a 0-d view, None without biases), applies the nonlinearity and
    writes ``write`` [C] scaled by the result.  SwiGLU neurons also read a
    ``gate`` [C] (``gate_bias``): they write silu(gate . x) * (read . x)."""

    def __init__(self, layer, index, block_weights, gated):
        self.layer, self.index = layer, index
        W, b = block_weights.c_fc.weight, block_weights.c_fc.bias
        F = W.shape[1] // 2 if gated else W.shape[1]
        up = F + index if gated else index
        self.read = _view(W[:, up])
        self.bias = None if b is None else _view(b[up, ...])
        self.gate = _view(W[:, index]) if gated else None
        self.gate_bias = _view(b[index, ...]) if gated and b is not None else None
        self.write = _view(block_weights.mlp_c_proj.weight[index])

    def __repr__(self):
        return f"<Neuron L{self.layer}N{self.index}>"


class Neurons:
    """``neurons[n]`` for n in range(d_mlp); built on demand (there are many)."""

    def __init__(self, layer, block_weights, gated):
        self.layer, self._w, self._gated = layer, block_weights, gated
        self._n = block_weights.mlp_c_proj.weight.shape[0]

    def __len__(self):
        return self._n

    def __getitem__(self, n):
        if isinstance(n, slice):
            return [self[i] for i in range(*n.indices(self._n))]
        i = int(n)
        if not -self._n <= i < self._n:
            raise IndexError(f"layer {self.layer}: neuron index {n} out of range: there are "
                             f"d_mlp={self._n} (0..{self._n - 1})")
        return Neuron(self.layer, i % self._n, self._w, self._gated)

    def __iter__(self):
        return (self[i] for i in range(self._n))


class MLP:
    """A layer's MLP: ``neurons[n]``, plus W_in [C, F], b_in [F], W_out [F, C],
    b_out [C]; SwiGLU also W_gate [C, F], b_gate (TransformerLens's names:
    W_in is the "up" read)."""

    def __init__(self, layer, block_weights, gated):
        self.neurons = Neurons(layer, block_weights, gated)
        W, b = block_weights.c_fc.weight, block_weights.c_fc.bias
        F = len(self.neurons)
        self.W_in = _view(W[:, F:] if gated else W)
        self.b_in = None if b is None else _view(b[F:] if gated else b)
        self.W_gate = _view(W[:, :F]) if gated else None
        self.b_gate = _view(b[:F]) if gated and b is not None else None
        self.W_out, self.b_out = _view(block_weights.mlp_c_proj.weight), _view(block_weights.mlp_c_proj.bias)


class LayerNorm:
    """gain ``w`` [C] and bias ``b`` [C] (None for RMSNorm)."""

    def __init__(self, weights):
        self.w, self.b = _view(weights.weight), _view(weights.bias)


class Block:
    """One residual block: ``ln1``, ``attn``, ``ln2``, ``mlp``."""

    def __init__(self, index, block_weights, cfg):
        self.index = index
        self.ln1 = LayerNorm(block_weights.ln_1)
        self.attn = Attention(index, block_weights, cfg)
        self.ln2 = LayerNorm(block_weights.ln_2)
        self.mlp = MLP(index, block_weights, cfg.gated)

    def __repr__(self):
        return f"<Block {self.index}: {len(self.attn.heads)} heads, {len(self.mlp.neurons)} neurons>"


def model_blocks(cfg, weights):
    """The blocks of a loaded model, as a tuple of Block views."""
    return Indexed((Block(i, w, cfg) for i, w in enumerate(weights.blocks)), "block")


class Unembed:
    """``unembed[token]`` -> token's logit direction [C]: logit = norm_f(resid) @ it.

    ``W_U`` is the whole [C, V] matrix (a transposed view of lm_head)."""

    def __init__(self, lm_head):
        self._lm_head = lm_head

    def __len__(self):
        return self._lm_head.shape[0]

    def __getitem__(self, token):
        return _view(self._lm_head[token])

    @property
    def W_U(self):
        return _view(self._lm_head.T)

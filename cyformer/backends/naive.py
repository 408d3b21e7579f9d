"""The "naive" backend: the transformer in plain Python loops, written to be read.

This is the computational view of a transformer: each position owns a
residual-stream ``State`` (d_model floats) that layers can only *query*
(a dot product with some vector) and *update* (add a vector into, giving the
next state).  The embedding is a lookup table of states; an attention head
scores every visible earlier position (QK), turns the scores into weights
with a softmax and writes a weighted sum of values back (OV); an MLP is a
list of neurons, each reading one number, passing it through a nonlinearity
and writing one vector; the unembedding gives one logit per vocabulary entry.

That view leaves out details real models cannot do without.  They are here
too, each marked "GPT-2:" or "Llama:" where it happens:
  * positions.  GPT-2: a learned table, added to the token's embedding.
    Llama: nothing is added; instead each head's query and key vectors are
    turned by angles proportional to their position (rotary embeddings), so
    a score depends on what the two positions hold and how far apart they are;
  * normalisation: attention and the MLP read a normalised copy of the state
    (norm_1, norm_2), and the unembedding reads norm_f of the final state.
    The updates still go into the raw, un-normalised stream.  GPT-2: layer
    norm (zero mean, unit variance, gain and bias).  Llama: RMSNorm (unit
    root-mean-square, gain only);
  * biases after the linear maps.  GPT-2: everywhere.  Llama: none (Qwen2:
    on the query, key and value reads);
  * scores are divided by sqrt(d_head) before the softmax;
  * the nonlinearity.  GPT-2: GELU.  Llama: SwiGLU, a neuron with two reads,
    the gate through silu times the plain "up" read;
  * Llama: grouped-query attention.  Several heads share one key/value head:
    they ask different questions (their own queries) of the same keys and
    values, so the cache holds one copy per key/value head.

Arithmetic is Python floats (float64), so it is at least as accurate as the
float32 backends; only the returned logits are converted to float32.  NumPy
appears only to turn the weights into lists and the logits into an array.

It is slow (about a microsecond per multiply-add) and its weights as Python
lists take ~32 bytes per parameter: 4 GB for GPT-2 small.  So the lists are
built on the first ``run``, not at load, and this backend is meant for tiny
geometries: tests and reading.
"""

import math

import numpy as np

from .. import rope
from ..config import Config
from . import forward_each
from ..weights import BlockWeights, NormWeights, Weights, dequantized


def dot(a, b):
    """The dot product of two equally long lists of floats."""
    return sum(x * y for x, y in zip(a, b))


class State:
    """One position's residual stream: a list of d_model floats.

    Never changed in place: ``update`` returns the next state."""

    __slots__ = ("x",)

    def __init__(self, x):
        self.x = list(x)

    def query(self, q):
        """Read one number out of the state: its dot product with q [d_model]."""
        return dot(self.x, q)

    def update(self, u):
        """The next state: this one plus the update u [d_model]."""
        return State(a + b for a, b in zip(self.x, u))


def scaled(w, vector):
    """w * vector, element by element."""
    return [w * v for v in vector]


def added(a, b):
    """a + b, element by element."""
    return [x + y for x, y in zip(a, b)]


def softmax(scores):
    """Scores -> weights that are positive and sum to 1 (max subtracted so exp cannot overflow)."""
    top = max(scores)
    e = [math.exp(s - top) for s in scores]
    total = sum(e)
    return [x / total for x in e]


def gelu_new(x):
    """GPT-2: GELU, tanh approximation."""
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    """GELU, exact: x times the standard normal CDF at x."""
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def silu(x):
    """Llama: x times the logistic sigmoid of x (SwiGLU's gate)."""
    return x / (1.0 + math.exp(-x)) if x > -700 else 0.0


GELU = {"gelu_new": gelu_new, "gelu": gelu_erf}


def listed(a, n):
    """a weight array as a list, or n zeros where the family has no such bias."""
    return [0.0] * n if a is None else a.tolist()


class LayerNorm:
    """GPT-2: rescale a state to zero mean and unit variance, then apply a gain and a bias."""

    def __init__(self, w: NormWeights, eps):
        self.gain, self.bias, self.eps = w.weight.tolist(), w.bias.tolist(), eps

    def apply(self, state: State) -> State:
        n = len(state.x)
        mean = sum(state.x) / n
        var = sum((v - mean) ** 2 for v in state.x) / n
        inv = 1.0 / math.sqrt(var + self.eps)
        return State((v - mean) * inv * g + b for v, g, b in zip(state.x, self.gain, self.bias))


class RMSNorm:
    """Llama: rescale a state to unit root-mean-square, then apply a gain (no
    centring, no bias)."""

    def __init__(self, w: NormWeights, eps):
        self.gain, self.eps = w.weight.tolist(), eps

    def apply(self, state: State) -> State:
        ms = sum(v * v for v in state.x) / len(state.x)
        inv = 1.0 / math.sqrt(ms + self.eps)
        return State(v * inv * g for v, g in zip(state.x, self.gain))


NORMS = {"layer_norm": LayerNorm, "rms_norm": RMSNorm}


class Embedding:
    """A lookup table: one starting state per token id (wte), plus, GPT-2: one
    learned state per position (wpe), added in.  Llama: no position table."""

    def __init__(self, wte, wpe):
        self.tokens = [State(row) for row in wte.tolist()]       # V states
        self.positions = None if wpe is None else wpe.tolist()   # P vectors of d_model

    def apply(self, token, position) -> State:
        if self.positions is None:
            return self.tokens[token]
        return self.tokens[token].update(self.positions[position])


class Rotary:
    """Llama: turn a query or key vector by its position.  Entry i pairs with
    entry i + d_head/2, and the pair turns by the angle position x freq[i]:
    fast for the first pairs, slow for the last.  The cosines and sines come
    from cyformer.rope, the tables every backend uses."""

    def __init__(self, cfg):
        self.freq = rope.inv_freq(cfg)

    def apply(self, vec, position):
        half = len(vec) // 2
        cos, sin = rope.rows(self.freq, position, position + 1)  # the table's row, made when needed
        c, s = cos[0].tolist(), sin[0].tolist()
        a, b = vec[:half], vec[half:]
        return ([x * ci - y * si for x, y, ci, si in zip(a, b, c, s)]
                + [y * ci + x * si for x, y, ci, si in zip(a, b, c, s)])


def project(state, reads, biases):
    """The state queried with each read vector, plus its bias."""
    return [state.query(r) + b for r, b in zip(reads, biases)]


class KVHead:
    """What a position offers to be found by (its key) and what it hands over
    when found (its value): d_head reads each.  GPT-2: one per head.  Llama:
    one shared by a group of query heads."""

    def __init__(self, W_K, b_K, W_V, b_V):
        self.W_K, self.b_K = W_K, b_K   # d_head read vectors of d_model, d_head biases
        self.W_V, self.b_V = W_V, b_V

    def append(self, states, positions, keys, values, rotary):
        """Each new position's key and value onto this head's cached lists."""
        for state, p in zip(states, positions):
            k = project(state, self.W_K, self.b_K)
            keys.append(rotary.apply(k, p) if rotary else k)
            values.append(project(state, self.W_V, self.b_V))


class AttnHead:
    """One head.  Its query vector has d_head entries; entry j is the state
    queried with one d_model vector (a column of c_attn) plus a bias.  W_O
    holds d_head write vectors: the head's output is their sum weighted by
    the entries of the mixed value vector."""

    def __init__(self, W_Q, b_Q, kv_index, W_O, d_head):
        self.W_Q, self.b_Q = W_Q, b_Q   # d_head read vectors of d_model, d_head biases
        self.kv_index = kv_index        # which key/value head it asks (Llama: shared)
        self.W_O = W_O                  # d_head write vectors of d_model
        self.scale = 1.0 / math.sqrt(d_head)  # scores are divided by sqrt(d_head)

    def apply(self, states, positions, keys, values, rotary):
        """states: the normalised states of the new positions, at ``positions``.
        keys, values: the key/value head's vectors of every position so far,
        the new ones included.  Returns one update per new position."""
        updates = []
        for state, p in zip(states, positions):
            q = project(state, self.W_Q, self.b_Q)
            if rotary:
                q = rotary.apply(q, p)
            # Position p sees itself and every earlier one, never a later one
            # (causal attention): keys 0 .. p.
            scores = [dot(q, k) * self.scale for k in keys[:p + 1]]   # QK circuit
            weights = softmax(scores)
            mixed = [0.0] * len(q)
            for w, v in zip(weights, values):
                mixed = added(mixed, scaled(w, v))
            update = [0.0] * len(self.W_O[0])                           # OV circuit
            for z, write in zip(mixed, self.W_O):
                update = added(update, scaled(z, write))
            updates.append(update)
        return updates


class AttnLayer:
    """The only place positions mix: every head's update, summed, plus (GPT-2) c_proj's bias."""

    def __init__(self, heads, kv_heads, bias, rotary):
        self.heads, self.kv_heads, self.bias, self.rotary = heads, kv_heads, bias, rotary

    def apply(self, states, positions, keys, values):
        """keys[g], values[g]: key/value head g's cached vectors, one per earlier position."""
        for g, kv in enumerate(self.kv_heads):
            kv.append(states, positions, keys[g], values[g], self.rotary)
        updates = [list(self.bias) for _ in states]
        for head in self.heads:
            g = head.kv_index
            for i, u in enumerate(head.apply(states, positions, keys[g], values[g], self.rotary)):
                updates[i] = added(updates[i], u)
        return updates


class Neuron:
    """Reads one number from the state, passes it through the nonlinearity,
    writes that much of its ``write`` vector."""

    __slots__ = ("read", "bias", "write")

    def __init__(self, read, bias, write):
        self.read, self.bias, self.write = read, bias, write

    def activation(self, state, nonlinear):
        return nonlinear(state.query(self.read) + self.bias)


class GatedNeuron:
    """Llama: reads two numbers, the gate and the "up" value; its activation
    is silu(gate) times up, so the gate decides how much of up gets written."""

    __slots__ = ("gate", "gate_bias", "up", "up_bias", "write")

    def __init__(self, gate, gate_bias, up, up_bias, write):
        self.gate, self.gate_bias, self.up, self.up_bias = gate, gate_bias, up, up_bias
        self.write = write

    def activation(self, state, nonlinear):
        return (silu(state.query(self.gate) + self.gate_bias)
                * (state.query(self.up) + self.up_bias))


class MLPLayer:
    """d_mlp neurons, each independent of the others, on one position."""

    def __init__(self, neurons, bias, nonlinear):
        self.neurons, self.bias, self.nonlinear = neurons, bias, nonlinear

    def apply(self, state: State):
        update = list(self.bias)  # GPT-2: c_proj's bias (Llama: zeros)
        for n in self.neurons:
            update = added(update, scaled(n.activation(state, self.nonlinear), n.write))
        return update


class ResBlock:
    """Attention then MLP, each reading a normalised copy of the stream."""

    def __init__(self, w: BlockWeights, cfg: Config, rotary):
        C, H, G, D, F = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.d_head, cfg.d_mlp
        reads = w.c_attn.weight.T.tolist()           # (H + 2G) D read vectors: q | k | v heads
        biases = listed(w.c_attn.bias, (H + 2 * G) * D)
        writes = w.attn_c_proj.weight.tolist()       # H D write vectors: head h owns rows h*D .. h*D+D-1

        def rows(lst, head):  # the D rows of head `head`, counted over q, k, v heads in turn
            return lst[head * D:(head + 1) * D]

        kv_heads = [KVHead(rows(reads, H + g), rows(biases, H + g),
                           rows(reads, H + G + g), rows(biases, H + G + g)) for g in range(G)]
        heads = [AttnHead(rows(reads, h), rows(biases, h), h // (H // G), rows(writes, h), D)
                 for h in range(H)]
        Norm = NORMS[cfg.norm]
        self.norm_1 = Norm(w.ln_1, cfg.norm_eps)
        self.attn = AttnLayer(heads, kv_heads, listed(w.attn_c_proj.bias, C), rotary)
        self.norm_2 = Norm(w.ln_2, cfg.norm_eps)
        fc_reads = w.c_fc.weight.T.tolist()
        fc_bias = listed(w.c_fc.bias, len(fc_reads))
        out = w.mlp_c_proj.weight.tolist()
        if cfg.gated:  # the first F reads are the gates, the next F the up values
            neurons = [GatedNeuron(fc_reads[n], fc_bias[n], fc_reads[F + n], fc_bias[F + n], out[n])
                       for n in range(F)]
            nonlinear = None
        else:
            neurons = [Neuron(r, b, wr) for r, b, wr in zip(fc_reads, fc_bias, out)]
            nonlinear = GELU[cfg.gelu]
        self.mlp = MLPLayer(neurons, listed(w.mlp_c_proj.bias, C), nonlinear)

    def apply(self, states, positions, keys, values):
        """The next states of the new positions."""
        updates = self.attn.apply([self.norm_1.apply(s) for s in states], positions, keys, values)
        states = [s.update(u) for s, u in zip(states, updates)]
        return [s.update(self.mlp.apply(self.norm_2.apply(s))) for s in states]


class Unembedding:
    """One logit per vocabulary entry: the final state queried with that token's
    vector (lm_head, which is wte when tied)."""

    def __init__(self, lm_head, bias=None):
        self.queries = lm_head.tolist()  # V vectors of d_model
        self.bias = None if bias is None else bias.tolist()  # b_U, after weight processing

    def apply(self, state: State):
        logits = [state.query(q) for q in self.queries]
        return logits if self.bias is None else [a + b for a, b in zip(logits, self.bias)]


class NaiveCache:
    """What attention needs of earlier positions: ``keys[layer][g]`` and
    ``values[layer][g]`` are lists with one d_head vector per position, for each
    key/value head g."""

    def __init__(self, cfg: Config, capacity):
        cap = int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"NaiveCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        self.capacity = cap
        self.keys = [[[] for _ in range(cfg.n_kv_head)] for _ in range(cfg.n_layer)]
        self.values = [[[] for _ in range(cfg.n_kv_head)] for _ in range(cfg.n_layer)]
        self.length = 0


class NaiveBackend:
    """Embedding, residual blocks, final norm and unembedding, in loops."""

    name = "naive"
    supports_hooks = False
    exact_chunk = None  # not checked to be bitwise the same however a prefill is split

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = dequantized(weights)  # smaller formats are widened first
        self.threads = threads  # unused: one Python thread does everything
        self._model = None      # the weights as lists, built on the first run

    def new_cache(self, capacity, reuse=False):
        """reuse: part of the shared interface; a new cache every time here."""
        return NaiveCache(self.config, capacity)

    def _lists(self):
        """Convert the weights to Python lists once (slow and large: see the module doc)."""
        if self._model is None:
            w, cfg = self.weights, self.config
            rotary = Rotary(cfg) if cfg.position == "rotary" else None
            self._model = (Embedding(w.wte, w.wpe),
                           [ResBlock(b, cfg, rotary) for b in w.blocks],
                           NORMS[cfg.norm](w.ln_f, cfg.norm_eps),  # a last norm
                           Unembedding(w.lm_head, w.lm_head_bias))
        return self._model

    def forward_batch(self, batch):
        """Logits [B, T, V] of B fresh sequences (batch [B, T]), one at a time."""
        return forward_each(self, batch)

    def step_batch(self, tokens, caches):
        """One decode step for B sequences: tokens [B], caches B caches, each
        advanced by one; returns logits [B, V] (a loop of run)."""
        return np.concatenate([self.run(np.array([t], dtype=np.int64), kv) for t, kv in zip(tokens, caches)])

    def run(self, ids, kv: NaiveCache, last_only=False):
        """Feed token ids [T] after the kv.length cached positions; returns
        float32 logits [T, V] (or [1, V] with last_only)."""
        embedding, blocks, ln_f, unembedding = self._lists()
        past, tokens = kv.length, [int(t) for t in ids]
        if past + len(tokens) > kv.capacity:
            raise ValueError(f"run: {past} cached + {len(tokens)} new positions exceed the cache's "
                             f"capacity of {kv.capacity}")
        positions = [past + i for i in range(len(tokens))]
        states = [embedding.apply(t, p) for t, p in zip(tokens, positions)]
        for layer, block in enumerate(blocks):
            states = block.apply(states, positions, kv.keys[layer], kv.values[layer])
        kv.length = past + len(tokens)
        if last_only:
            states = states[-1:]
        return np.array([unembedding.apply(ln_f.apply(s)) for s in states], dtype=np.float32)

"""The "naive" backend: GPT-2 in plain Python loops, written to be read.

This is the computational view of a transformer: each position owns a
residual-stream ``State`` (d_model floats) that layers can only *query*
(a dot product with some vector) and *update* (add a vector into, giving the
next state).  The embedding is a lookup table of states; an attention head
scores every visible earlier position (QK), turns the scores into weights
with a softmax and writes a weighted sum of values back (OV); an MLP is a
list of neurons, each reading one number, passing it through GELU and
writing one vector; the unembedding gives one logit per vocabulary entry.

That view leaves out details GPT-2 cannot do without.  They are here too,
each marked "GPT-2:" where it happens:
  * position embeddings: a learned table, added to the token's embedding;
  * layer norm: attention and the MLP read a normalised copy of the state
    (ln_1, ln_2), and the unembedding reads ln_f of the final state.  The
    updates still go into the raw, un-normalised stream;
  * biases after every linear map (query, key, value, output, neuron read,
    MLP output);
  * scores are divided by sqrt(d_head) before the softmax;
  * the nonlinearity is GELU (tanh approximation, or erf for "gelu").

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

from ..config import Config
from ..weights import BlockWeights, LayerNormWeights, Weights


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


GELU = {"gelu_new": gelu_new, "gelu": gelu_erf}


class LayerNorm:
    """GPT-2: rescale a state to zero mean and unit variance, then apply a gain and a bias."""

    def __init__(self, w: LayerNormWeights, eps):
        self.gain, self.bias, self.eps = w.weight.tolist(), w.bias.tolist(), eps

    def apply(self, state: State) -> State:
        n = len(state.x)
        mean = sum(state.x) / n
        var = sum((v - mean) ** 2 for v in state.x) / n
        inv = 1.0 / math.sqrt(var + self.eps)
        return State((v - mean) * inv * g + b for v, g, b in zip(state.x, self.gain, self.bias))


class Embedding:
    """A lookup table: one starting state per token id (wte), plus, GPT-2: one
    learned state per position (wpe), added in."""

    def __init__(self, wte, wpe):
        self.tokens = [State(row) for row in wte.tolist()]  # V states
        self.positions = wpe.tolist()                       # P vectors of d_model

    def apply(self, token, position) -> State:
        return self.tokens[token].update(self.positions[position])


class AttnHead:
    """One head.  Its query, key and value vectors each have d_head entries;
    entry j is the state queried with one d_model vector (a column of c_attn)
    plus a bias.  W_O holds d_head write vectors: the head's output is their
    sum weighted by the entries of the mixed value vector."""

    def __init__(self, W_Q, b_Q, W_K, b_K, W_V, b_V, W_O, d_head):
        self.W_Q, self.b_Q = W_Q, b_Q  # d_head read vectors of d_model, d_head biases
        self.W_K, self.b_K = W_K, b_K
        self.W_V, self.b_V = W_V, b_V
        self.W_O = W_O                  # d_head write vectors of d_model
        self.scale = 1.0 / math.sqrt(d_head)  # GPT-2: scores are divided by sqrt(d_head)

    @staticmethod
    def project(state, reads, biases):
        return [state.query(r) + b for r, b in zip(reads, biases)]

    def apply(self, states, keys, values):
        """states: the normalised states of the new positions, in order.
        keys, values: this head's cached vectors of all earlier positions;
        each new position's key and value are appended.  Returns one update
        per new position."""
        updates = []
        for state in states:
            q = self.project(state, self.W_Q, self.b_Q)
            keys.append(self.project(state, self.W_K, self.b_K))
            values.append(self.project(state, self.W_V, self.b_V))
            # This position sees itself and every earlier one, never a later one:
            # the keys list holds exactly those (causal attention).
            scores = [dot(q, k) * self.scale for k in keys]       # QK circuit
            weights = softmax(scores)
            mixed = [0.0] * len(q)
            for w, v in zip(weights, values):
                mixed = added(mixed, scaled(w, v))
            update = [0.0] * len(self.W_O[0])                      # OV circuit
            for z, write in zip(mixed, self.W_O):
                update = added(update, scaled(z, write))
            updates.append(update)
        return updates


class AttnLayer:
    """The only place positions mix: every head's update, summed, plus (GPT-2) c_proj's bias."""

    def __init__(self, heads, bias):
        self.heads, self.bias = heads, bias

    def apply(self, states, keys, values):
        """keys[h], values[h]: head h's cached vectors, one per earlier position."""
        updates = [list(self.bias) for _ in states]
        for h, head in enumerate(self.heads):
            for i, u in enumerate(head.apply(states, keys[h], values[h])):
                updates[i] = added(updates[i], u)
        return updates


class Neuron:
    """Reads one number from the state, passes it through the nonlinearity,
    writes that much of its ``write`` vector."""

    __slots__ = ("read", "bias", "write")

    def __init__(self, read, bias, write):
        self.read, self.bias, self.write = read, bias, write


class MLPLayer:
    """d_mlp neurons, each independent of the others, on one position."""

    def __init__(self, neurons, bias, nonlinear):
        self.neurons, self.bias, self.nonlinear = neurons, bias, nonlinear

    def apply(self, state: State):
        update = list(self.bias)  # GPT-2: c_proj's bias
        for n in self.neurons:
            act = self.nonlinear(state.query(n.read) + n.bias)
            update = added(update, scaled(act, n.write))
        return update


class ResBlock:
    """Attention then MLP, each reading a layer-normed copy of the stream."""

    def __init__(self, w: BlockWeights, cfg: Config):
        C, H, D = cfg.n_embd, cfg.n_head, cfg.d_head
        reads = w.c_attn.weight.T.tolist()   # 3C read vectors: q | k | v, head by head
        biases = w.c_attn.bias.tolist()      # 3C
        writes = w.attn_c_proj.weight.tolist()  # C write vectors: head h owns rows h*D .. h*D+D-1

        def part(rows, which, h):  # head h's D rows of q (0), k (1) or v (2)
            start = which * C + h * D
            return rows[start:start + D]

        heads = [AttnHead(part(reads, 0, h), part(biases, 0, h), part(reads, 1, h), part(biases, 1, h),
                          part(reads, 2, h), part(biases, 2, h), writes[h * D:(h + 1) * D], D)
                 for h in range(H)]
        self.ln_1 = LayerNorm(w.ln_1, cfg.layer_norm_epsilon)
        self.attn = AttnLayer(heads, w.attn_c_proj.bias.tolist())
        self.ln_2 = LayerNorm(w.ln_2, cfg.layer_norm_epsilon)
        neurons = [Neuron(r, b, wr) for r, b, wr in
                   zip(w.c_fc.weight.T.tolist(), w.c_fc.bias.tolist(), w.mlp_c_proj.weight.tolist())]
        self.mlp = MLPLayer(neurons, w.mlp_c_proj.bias.tolist(), GELU[cfg.gelu])

    def apply(self, states, keys, values):
        """The next states of the new positions."""
        updates = self.attn.apply([self.ln_1.apply(s) for s in states], keys, values)
        states = [s.update(u) for s, u in zip(states, updates)]
        return [s.update(self.mlp.apply(self.ln_2.apply(s))) for s in states]


class Unembedding:
    """One logit per vocabulary entry: the final state queried with that token's
    vector (lm_head, which is wte when tied)."""

    def __init__(self, lm_head):
        self.queries = lm_head.tolist()  # V vectors of d_model

    def apply(self, state: State):
        return [state.query(q) for q in self.queries]


class NaiveCache:
    """What attention needs of earlier positions: keys[layer][head] and
    values[layer][head] are lists with one d_head vector per position."""

    def __init__(self, cfg: Config, capacity):
        cap = int(capacity)
        if not 1 <= cap <= cfg.n_positions:
            raise ValueError(f"NaiveCache: capacity must be in [1, {cfg.n_positions}], got {capacity}")
        self.capacity = cap
        self.keys = [[[] for _ in range(cfg.n_head)] for _ in range(cfg.n_layer)]
        self.values = [[[] for _ in range(cfg.n_head)] for _ in range(cfg.n_layer)]
        self.length = 0


class NaiveBackend:
    """Embedding, residual blocks, final layer norm and unembedding, in loops."""

    name = "naive"

    def __init__(self, cfg: Config, weights: Weights, threads: int):
        self.config = cfg
        self.weights = weights
        self.threads = threads  # unused: one Python thread does everything
        self._model = None      # the weights as lists, built on the first run

    def new_cache(self, capacity, reuse=False):
        """reuse: part of the shared interface; a new cache every time here."""
        return NaiveCache(self.config, capacity)

    def _lists(self):
        """Convert the weights to Python lists once (slow and large: see the module doc)."""
        if self._model is None:
            w, cfg = self.weights, self.config
            self._model = (Embedding(w.wte, w.wpe),
                           [ResBlock(b, cfg) for b in w.blocks],
                           LayerNorm(w.ln_f, cfg.layer_norm_epsilon),  # GPT-2: a last layer norm
                           Unembedding(w.lm_head))
        return self._model

    def run(self, ids, kv: NaiveCache, last_only=False):
        """Feed token ids [T] after the kv.length cached positions; returns
        float32 logits [T, V] (or [1, V] with last_only)."""
        embedding, blocks, ln_f, unembedding = self._lists()
        past, tokens = kv.length, [int(t) for t in ids]
        if past + len(tokens) > kv.capacity:
            raise ValueError(f"run: {past} cached + {len(tokens)} new positions exceed the cache's "
                             f"capacity of {kv.capacity}")
        states = [embedding.apply(t, past + i) for i, t in enumerate(tokens)]
        for layer, block in enumerate(blocks):
            states = block.apply(states, kv.keys[layer], kv.values[layer])
        kv.length = past + len(tokens)
        if last_only:
            states = states[-1:]
        return np.array([unembedding.apply(ln_f.apply(s)) for s in states], dtype=np.float32)

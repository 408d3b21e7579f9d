"""Tutorial: looking inside the bundled model (docs/hooks.py runs it; needs matplotlib)."""
# %% [markdown]
# # Looking inside
#
# This follows the picture of "Transformers for software engineers"
# (Nelson Elhage, 2022): a transformer keeps one **state vector** per position,
# the *residual stream*; every layer reads it (a *query*) and adds an *update*
# to it, never overwriting it. Attention heads are the only parts that move
# information between positions; MLP neurons each read the state along one
# vector and write along another. cyformer names the activations as
# TransformerLens does (`blocks.{i}.hook_resid_post`, ...), and hands out the
# weights as read-only views shaped the way the math reads.

# %%
import numpy as np
from matplotlib.figure import Figure

import cyformer
from cyformer.interp import direct_logit_attribution, logit_lens, save_html, save_png

model = cyformer.load()
prompt = "for i in range(10):\n    print(i)\nfor j in range("
ids = model.encode(prompt)
print(len(ids), "tokens:", [model.decode([i]) for i in ids])

# %% [markdown]
# ## The residual stream
#
# `run_with_cache` runs one forward pass and keeps the activations at the hook
# points. The stream after block *i* is the stream before it plus that block's
# attention update plus its MLP update: a sum, exactly.

# %%
logits, cache = model.run_with_cache(ids)
L = model.config.n_layer
for i in range(L):
    pre, post = cache[f"blocks.{i}.hook_resid_pre"], cache[f"blocks.{i}.hook_resid_post"]
    update = cache[f"blocks.{i}.hook_attn_out"] + cache[f"blocks.{i}.hook_mlp_out"]
    print(f"block {i}: |state| {np.linalg.norm(pre[-1]):6.1f} -> {np.linalg.norm(post[-1]):6.1f}, "
          f"post - (pre + updates) = {np.abs(post - pre - update).max():.1e}")

# %% [markdown]
# ## One attention head: where it looks (QK) and what it moves (OV)
#
# A head's attention score between a query position and a key position is
# `x_q @ W_Q @ W_K.T @ x_k / sqrt(d_head)`: the **QK circuit** `W_Q W_K^T`. What it
# writes into the stream for a position it attends to is `x @ W_V @ W_O`: the
# **OV circuit**. Both are `d_model x d_model` matrices of rank at most
# `d_head`, kept as their two factors.

# %%
head = model.blocks[1].attn.heads[2]
print(head, head.W_Q.shape, head.W_O.shape)
qk, ov = head.qk_circuit(), head.ov_circuit()
print(qk, "\nOV singular values:", np.round(ov.singular_values()[:5], 2))

x = cache["blocks.1.ln1.hook_normalized"]          # what the head reads: the normed stream
scores = (x[-1] @ qk @ x.T) / np.sqrt(model.config.d_head)
q = x[-1] @ head.W_Q + head.b_Q                    # with the biases, as the model computes it
k = x @ head.W_K + head.b_K
print("scores from the last token (circuit, bias-free):", np.round(scores[-5:], 2))
print("scores the model used:                          ",
      np.round(cache["blocks.1.attn.hook_attn_scores"][2, -1, -5:], 2))
print("q.k / sqrt(d) with biases:                      ", np.round((k @ q)[-5:] / np.sqrt(model.config.d_head), 2))

# %% [markdown]
# The attention patterns as pictures: every head of the first two layers as a
# PNG, and the same as a self-contained HTML page (hover a cell for its weight).

# %%
patterns = {(i, h): cache[f"blocks.{i}.attn.hook_pattern"][h]
            for i in range(2) for h in range(model.config.n_head)}
labels = [model.decode([i]) for i in ids]
save_png("inside_attention.png", labels, patterns)
save_html("inside_attention.html", labels, patterns)

# %% [markdown]
# ![attention patterns of layers 0 and 1](inside_attention.png)
#
# [The same patterns as HTML](inside_attention.html).
#
# ## One neuron: its read and write vectors
#
# Neuron *n* of block *i* reads the (normed) stream along `read`, adds its
# bias, applies GELU, and writes `write` scaled by the result. Its
# activation in the cache is exactly that read.

# %%
neuron = model.blocks[0].mlp.neurons[7]
x = cache["blocks.0.ln2.hook_normalized"]
pre = x @ neuron.read + neuron.bias
print(neuron, "read", neuron.read.shape, "write", neuron.write.shape)
print("pre-activation, by hand:", np.round(pre[-4:], 3))
print("from the cache:         ", np.round(cache["blocks.0.mlp.hook_pre"][-4:, 7], 3))
# Which tokens does its write push up?  Read it through the unembedding.
top = np.argsort(-(model.unembed.W_U.T @ neuron.write))[:8]
print("its write favours:", [model.decode([int(t)]) for t in top])

# %% [markdown]
# ## Ablating a head
#
# A hook gets an activation and may return a replacement. Zeroing head 2's
# output in layer 1 (its `z`, before `W_O`) removes its update; how much the
# next-token prediction moves says how much the model leaned on it here.

# %%
def ablate_head_2(z, name):                  # z: [T, head, d_head]
    z[:, 2] = 0
    return z


def top_tokens(lg, n=3):
    p = np.exp(lg[-1] - lg[-1].max())
    p /= p.sum()
    return [(model.decode([int(t)]), round(float(p[t]), 3)) for t in np.argsort(-p)[:n]]


ablated = model.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", ablate_head_2)])
print("clean:  ", top_tokens(logits))
print("ablated:", top_tokens(ablated))

# %% [markdown]
# ## Patching the residual stream
#
# Run a second prompt that differs in one place, and copy the clean run's
# stream into it at one layer and position: where the patch brings the clean
# prediction back is where the information that differs is carried.

# %%
corrupt = model.encode("for i in range(10):\n    print(x)\nfor j in range(")
assert len(corrupt) == len(ids)
target = int(np.argmax(logits[-1]))           # the clean run's top next token
corrupt_logits = model.forward(corrupt)
print("clean logit of", repr(model.decode([target])), round(float(logits[-1, target]), 2),
      "| corrupted", round(float(corrupt_logits[-1, target]), 2))
recovered = np.zeros((L, len(ids)))
for layer in range(L):
    name = f"blocks.{layer}.hook_resid_pre"
    for pos in range(len(ids)):
        def patch(resid, _, pos=pos):
            resid[pos] = cache[name][pos]
            return resid
        recovered[layer, pos] = model.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])[-1, target]
print("patched logit, rows = layer, columns = position:")
print(np.round(recovered, 1))

fig = Figure(figsize=(8, 2.6), constrained_layout=True)
ax = fig.subplots()
image = ax.imshow(recovered, cmap="RdBu_r", aspect="auto")
ax.set_yticks(range(L), [f"resid_pre {i}" for i in range(L)])
ax.set_xticks(range(len(ids)), [repr(model.decode([i]))[1:-1] for i in ids], rotation=90, fontsize=7)
fig.colorbar(image, label=f"logit of {model.decode([target])!r}")
fig.savefig("inside_patching.png", dpi=100)

# %% [markdown]
# ![activation patching](inside_patching.png)
#
# ## The logit lens
#
# Read the stream after each layer through the final layer norm and the
# unembedding as if it were the last: which token would the model say so far?

# %%
lens = logit_lens(model, ids, k=1)
print(lens.format(width=8))

# %% [markdown]
# ## Direct logit attribution
#
# With the final layer norm's scale frozen at its value in this run, the
# logit of a token is a sum over everything that wrote into the stream: the
# embeddings, each head, each MLP layer. The parts add up to the logit.

# %%
dla = direct_logit_attribution(model, ids, target, cache=cache)
print(f"logit {dla.logit:.3f}, sum of the parts {dla.total():.3f}")
for name, value in dla.top(8):
    print(f"  {name:14} {value:+.3f}")

fig = Figure(figsize=(8, 3), constrained_layout=True)
ax = fig.subplots()
names, values = zip(*dla.items())
ax.bar(range(len(values)), values, color=["#c44" if v < 0 else "#36c" for v in values])
ax.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
ax.set_ylabel(f"contribution to {model.decode([target])!r}")
fig.savefig("inside_attribution.png", dpi=100)

# %% [markdown]
# ![direct logit attribution](inside_attribution.png)

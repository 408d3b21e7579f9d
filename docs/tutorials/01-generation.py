"""Tutorial: generation and sampling with the bundled model (docs/hooks.py runs it)."""
# %% [markdown]
# # Generation and sampling
#
# Everything here runs on the model that ships inside the wheel: a 4.3M-parameter
# GPT-2 trained on Python source (the standard library and 60 PyPI packages),
# 4 layers, 4 heads, a context of 512 tokens and a byte-level BPE vocabulary of
# 4096 tokens. It is tiny, so it
# writes Python-*looking* text; what matters here is how generation works.

# %%
import numpy as np

import cyformer

model = cyformer.load()          # no path: the bundled model
print(model)
print(model.generation_config)

# %% [markdown]
# ## Text in, token ids out
#
# `encode` and `decode` use the checkpoint's `tokenizer.json`. The ids are this
# model's own: a GPT-2 checkpoint has a different vocabulary (50257 tokens).

# %%
ids = model.encode("def add(a, b):")
print(ids)
print([model.decode([i]) for i in ids])

# %% [markdown]
# ## One forward pass: the next token
#
# `forward` takes token ids (not text) and returns the logits of every
# position, `[T, vocab]`. The last row scores the token that comes next.

# %%
logits = model.forward(ids)
last = logits[-1].astype(np.float64)
probs = np.exp(last - last.max())
probs /= probs.sum()
for t in np.argsort(-probs)[:5]:
    print(f"{model.decode([int(t)])!r:12} {probs[t]:.1%}")

# %% [markdown]
# ## Greedy decoding repeats itself
#
# `temperature=0` always takes the most likely token. For a model this small
# that soon falls into a loop, which is why the bundled model's
# `generation_config.json` asks for sampling by default.

# %%
greedy = model.generate("def fib(n):", max_new_tokens=30, temperature=0)
print(repr(greedy))

# %% [markdown]
# ## Sampling
#
# Arguments left out take the checkpoint's defaults (here temperature 0.8,
# top-k 40, repetition penalty 1.2). `seed` makes a sample repeatable;
# `top_p` keeps the smallest set of tokens whose probability reaches p.
# The result is a `str` carrying the new tokens' ids, why generation stopped
# and timings.

# %%
text = model.generate("def fib(n):", max_new_tokens=40, seed=3)
print(text)
print(text.finish_reason, len(text.token_ids), "tokens")
print(text == model.generate("def fib(n):", max_new_tokens=40, seed=3))   # same seed, same text

# %%
hot = model.generate("def fib(n):", max_new_tokens=40, temperature=1.2, top_p=0.9, seed=3)
print(hot)

# %% [markdown]
# ## Streaming, stop strings, token ids
#
# `stream` yields text pieces as they are produced (never half a UTF-8
# character). A stop string ends generation and is cut from the text. A list
# of ids as the prompt gives ids back.

# %%
pieces = list(model.stream("class Stack:\n", max_new_tokens=60, stop="\n\n", seed=1))
print(pieces[:8])
print("".join(pieces))

out = model.generate(model.encode("import os\n"), max_new_tokens=8, seed=1)
print(out, out.finish_reason)

# %% [markdown]
# ## Prompts longer than the context
#
# The model sees at most 256 positions. A longer prompt is refused, unless
# `truncate=True` keeps its end (leaving room for the new tokens); the command
# line has `--truncate`.

# %%
long_prompt = "x = 1\n" * 200
try:
    model.generate(long_prompt, max_new_tokens=10)
except ValueError as e:
    print("refused:", e)
kept = model.generate(long_prompt, max_new_tokens=10, truncate=True, seed=1)
print(kept.stats["prompt_tokens"], "prompt tokens kept,", kept.stats["truncated_tokens"], "dropped")

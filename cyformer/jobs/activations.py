"""collect: activations at chosen hook points for every token of a corpus.

Each document runs once through ``model.run_with_cache(ids, names=hooks)``;
the activations of all its tokens are appended to its shard along with
where they came from.  Hook points with a position axis first (the residual
stream, q/k/v/z, MLP pre/post, ...) qualify; attention scores and patterns,
whose key axis grows with the position, do not.

A document longer than ``max_tokens`` (default and at most the context,
n_positions) keeps its first max_tokens tokens; its row is listed under
"truncated" in the shard's manifest record.

Shard arrays (N = tokens in the shard, in corpus order, positions ascending):
    token_ids   [N]          int32
    doc         [N]          int64   the corpus row of each token
    pos         [N]          int32   its position in the document
    HOOK NAME   [N, ...]     float32 or float16 (the hook's shape without T)
"""

import numpy as np

from .job import Job, encode

DTYPES = ("float32", "float16")
FORMATS = {"safetensors": ".safetensors", "npy": ""}


class Collect(Job):
    name, stem = "collect", "activations"
    default_shard_rows = 64  # a shard of 64 documents of 1024 tokens of GPT-2 small: 200 MB a hook

    def __init__(self, hooks, dtype="float32", format="safetensors", max_tokens=None):
        if isinstance(hooks, str):
            hooks = [hooks]
        if hooks is None or isinstance(hooks, (bytes, dict)) or not hasattr(hooks, "__iter__"):
            raise TypeError(f"collect: hooks must be a hook name or a list of them "
                            f"(model.hook_names() lists them), got {type(hooks).__name__}")
        self.hooks = list(hooks)
        bad = [h for h in self.hooks if not isinstance(h, str)]
        if bad:
            raise TypeError(f"collect: hooks must be hook names (str), got {type(bad[0]).__name__}")
        self.dtype = dtype
        self.format = format
        self.max_tokens = max_tokens
        self.shapes = None

    @property
    def ext(self):
        return FORMATS[self.format]

    def params(self):
        return {"hooks": self.hooks, "dtype": self.dtype, "max_tokens": self.max_tokens}

    def check(self, model):
        super().check(model)
        from ..hooks import position_axis, select

        if not self.hooks:
            raise ValueError("collect: name at least one hook point (model.hook_names() lists them)")
        if len(set(self.hooks)) != len(self.hooks):
            raise ValueError(f"collect: a hook point is named twice in {self.hooks}")
        select(model.config, self.hooks, "collect")
        for h in self.hooks:
            if position_axis(h) != 0:
                raise ValueError(f"collect: {h} has a key axis that grows with the position; "
                                 "collect takes per-token points (e.g. blocks.0.hook_resid_post)")
        if self.dtype not in DTYPES:
            raise ValueError(f"collect: dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.format not in FORMATS:
            raise ValueError(f"collect: format must be one of {tuple(FORMATS)}, got {self.format!r}")
        n = model.config.n_positions
        if self.max_tokens is None:
            self.max_tokens = n
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) \
                or not 1 <= self.max_tokens <= n:
            raise ValueError(f"collect: max_tokens must be an integer in [1, n_positions={n}], "
                             f"got {self.max_tokens!r}")
        _, cache = model.run_with_cache([0], names=self.hooks)  # one token tells each shape
        self.shapes = {h: list(cache[h].shape[1:]) for h in self.hooks}

    def identity_extra(self):
        arrays = {"token_ids": {"shape": [], "dtype": "int32"}, "doc": {"shape": [], "dtype": "int64"},
                  "pos": {"shape": [], "dtype": "int32"}}
        arrays.update({h: {"shape": self.shapes[h], "dtype": self.dtype} for h in self.hooks})
        return {"arrays": arrays}

    def process(self, model, row, text, params):
        ids = encode(model, text)
        truncated = len(ids) > self.max_tokens
        ids = ids[:self.max_tokens]
        _, cache = model.run_with_cache(ids, names=self.hooks)
        return {"ids": np.asarray(ids, dtype=np.int32), "truncated": truncated,
                "acts": {h: cache[h].astype(self.dtype, copy=False) for h in self.hooks}}

    def tokens(self, result):
        return len(result["ids"])

    def write(self, results, path):
        from .shards import write_arrays

        arrays = {
            "token_ids": _cat([x["ids"] for _, x in results], (), np.int32),
            "doc": _cat([np.full(len(x["ids"]), r, np.int64) for r, x in results], (), np.int64),
            "pos": _cat([np.arange(len(x["ids"]), dtype=np.int32) for _, x in results], (), np.int32),
        }
        for h in self.hooks:
            arrays[h] = _cat([x["acts"][h] for _, x in results], self.shapes[h], self.dtype)
        extra = {"truncated": [r for r, x in results if x["truncated"]]}
        return write_arrays(arrays, path, self.format), extra


def _cat(parts, tail, dtype):
    return np.concatenate(parts) if parts else np.empty((0, *tail), dtype=dtype)

"""score: each document's log-likelihood under the model, and its perplexity.

Token t (t >= 1) is scored as ln p(ids[t] | ids[begin:t]) from the logits of
``model.forward`` over a window ids[begin:end] that holds it.  A document
longer than the context (n_positions) runs as a sliding window, as in the
transformers perplexity guide: windows start every ``stride`` tokens, each
is at most n_positions long, and each scores only the tokens that earlier
windows did not, so every token is scored once, with at least
n_positions - stride tokens of context once the first window is full.
Tokens with no earlier token in their window are not scored: the first one,
and with stride = n_positions the first of every window.

The log-softmax runs in float64 (max subtracted, then log-sum-exp), so the
sums do not lose the small per-token terms of a long document.

Shard columns (one row per document, in corpus order):
    row            int64    the corpus row (0-based; JSONL line - 1)
    id             string   the row's own ``id`` field; null where it has none
    n_tokens       int64    tokens scored
    logprob        float64  sum of their ln p (the document's log-likelihood, nats)
    perplexity     float64  exp(-logprob / n_tokens); null when n_tokens is 0
    token_ids      list<int32>    every token of the document   } with token_logprobs=True
    token_logprobs list<float64>  ln p of each; null where unscored }
"""

import numpy as np

from .job import Job, RowSkipped, encode, id_column

ROWS_PER_PASS = 32  # logits rows widened to float64 at a time ([32, V] doubles)


def log_softmax_at(logits, targets):
    """ln softmax(logits[r])[targets[r]] for every row r, in float64.

    logits [R, V] float32, targets [R] ints -> [R] float64.
    """
    out = np.empty(len(targets), dtype=np.float64)
    for a in range(0, len(targets), ROWS_PER_PASS):
        x = logits[a:a + ROWS_PER_PASS].astype(np.float64)
        m = x.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=1))
        t = np.asarray(targets[a:a + ROWS_PER_PASS])
        out[a:a + len(t)] = x[np.arange(len(t)), t] - lse
    return out


def windows(n, context, stride):
    """(begin, end, first) of each window over n tokens: run ids[begin:end],
    score tokens first..end-1."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n:
            break
    return out


def token_logprobs(model, ids, stride):
    """ln p of every token of ids [N] given the earlier ones -> [N] float64,
    NaN where a token is not scored (see the module docstring)."""
    ids = np.asarray(ids, dtype=np.int64)
    lp = np.full(len(ids), np.nan)
    for begin, end, first in windows(len(ids), model.config.n_positions, stride):
        if first >= end:
            continue
        logits = model.forward(ids[begin:end])        # [end - begin, V]
        lp[first:end] = log_softmax_at(logits[first - 1 - begin:end - 1 - begin], ids[first:end])
    return lp


class Score(Job):
    name, stem, ext, format = "score", "scores", ".parquet", "parquet"

    def __init__(self, stride=None, per_token=False):
        if not isinstance(per_token, (bool, np.bool_)):
            raise TypeError(f"score: per_token must be True or False, got {type(per_token).__name__}")
        self.stride = stride
        self.per_token = bool(per_token)

    def params(self):
        return {"stride": self.stride, "per_token": self.per_token}

    @classmethod
    def from_params(cls, params):
        return cls(params.get("stride"), params.get("per_token", False))

    def check(self, model):
        super().check(model)
        n = model.config.n_positions
        if self.stride is None:
            self.stride = max(1, n // 2)
        if isinstance(self.stride, bool) or not isinstance(self.stride, int) or not 1 <= self.stride <= n:
            raise ValueError(f"score: stride must be an integer in [1, n_positions={n}], got {self.stride!r}")

    def process(self, model, row, text, params):
        ids = encode(model, text)
        lp = token_logprobs(model, ids, self.stride)
        scored = ~np.isnan(lp)
        n = int(scored.sum())
        total = float(lp[scored].sum()) if n else 0.0
        result = {"n_tokens": n, "logprob": total, "perplexity": float(np.exp(-total / n)) if n else None,
                  "length": len(ids), "id": (params or {}).get("id")}
        if self.per_token:
            result["token_ids"] = np.asarray(ids, dtype=np.int32)
            result["token_logprobs"] = lp
        return result

    def tokens(self, result):
        return result["length"]

    def write(self, results, path):
        from .shards import write_parquet

        return write_parquet(self.table(results), path), {}

    def table(self, results):
        """The shard's pyarrow Table from [(row, result)] in row order."""
        import pyarrow as pa

        cols = {
            "row": pa.array([r for r, _ in results], pa.int64()),
            "id": id_column(results),
            "n_tokens": pa.array([x["n_tokens"] for _, x in results], pa.int64()),
            "logprob": pa.array([x["logprob"] for _, x in results], pa.float64()),
            "perplexity": pa.array([x["perplexity"] for _, x in results], pa.float64()),
        }
        if self.per_token:
            cols["token_ids"] = _lists([x["token_ids"] for _, x in results], pa.int32())
            cols["token_logprobs"] = _lists([x["token_logprobs"] for _, x in results], pa.float64())
        return pa.table(cols)


def _lists(arrays, type_):
    """A list<type_> column from 1-D arrays (NaN -> null for floats)."""
    import pyarrow as pa

    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.empty(0, type_.to_pandas_dtype())
    mask = np.isnan(flat) if flat.dtype.kind == "f" else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type_, mask=mask))


__all__ = ["Score", "log_softmax_at", "token_logprobs", "windows", "RowSkipped"]

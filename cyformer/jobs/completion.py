"""generate: a completion for every prompt of a corpus.

Each row's prompt runs through ``model.generate`` with the job's sampling
parameters, which a row overrides with fields of its own of the same names:
max_new_tokens, temperature, top_k, top_p, repetition_penalty, stop, seed.
A row without a seed gets ``seed + row`` (the job's seed, default 0), so a
sampled completion depends only on the row, never on which worker ran it.
A row whose values generate() refuses (a prompt longer than the context, a
negative temperature, ...) is skipped with generate()'s message.

Shard columns (one row per prompt, in corpus order):
    row            int64         the corpus row (0-based; JSONL line - 1)
    prompt_tokens  int32
    completion     string        the new text (a stop string is cut from it)
    token_ids      list<int32>   the new tokens
    finish_reason  string        "length", "eos", "stop" or "context"
    seed           int64         the seed the row was sampled with
"""

import json

from ..model_files import DEFAULT
from .job import Job, RowSkipped

ROW_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "stop", "seed")
_SAMPLING = ("temperature", "top_k", "top_p", "repetition_penalty")


class Generate(Job):
    name, stem, ext, format = "generate", "completions", ".parquet", "parquet"
    default_field = "prompt"

    def __init__(self, max_new_tokens=64, temperature=DEFAULT, top_k=DEFAULT, top_p=DEFAULT,
                 repetition_penalty=DEFAULT, stop=None, seed=0):
        self.defaults = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k,
                         "top_p": top_p, "repetition_penalty": repetition_penalty, "stop": stop}
        self.seed = seed

    def params(self):
        # DEFAULT (the checkpoint's generation_config.json) is recorded by name
        return {**{k: ("checkpoint" if v is DEFAULT else v) for k, v in self.defaults.items()},
                "seed": self.seed}

    def check(self, model):
        super().check(model)
        from .. import _checks

        _checks.integer("generate", "seed", self.seed)
        d = self.defaults
        if _checks.integer("generate", "max_new_tokens", d["max_new_tokens"]) < 0:
            raise ValueError(f"generate: max_new_tokens must be >= 0, got {d['max_new_tokens']}")
        model.generation_config.sampling(*(d[k] for k in _SAMPLING))  # bad values fail here, once

    def row_params(self, row):
        """The row's own sampling fields (JSON-able values only)."""
        own = {k: row.fields[k] for k in ROW_FIELDS if row.fields and row.fields.get(k) is not None}
        try:
            json.dumps(own)
        except (TypeError, ValueError):
            raise RowSkipped("its sampling fields are not plain numbers, strings or lists") from None
        return own

    def process(self, model, row, text, params):
        args = {**self.defaults, **{k: v for k, v in (params or {}).items() if k != "seed"}}
        seed = params.get("seed", self.seed + row) if params else self.seed + row
        if isinstance(args["stop"], list):
            args["stop"] = list(args["stop"])
        try:
            out = model.generate(text, seed=seed, **args)
        except (ValueError, TypeError) as e:
            raise RowSkipped(str(e)) from None
        return {"prompt_tokens": out.stats["prompt_tokens"], "completion": str(out),
                "token_ids": list(out.token_ids), "finish_reason": out.finish_reason, "seed": int(seed)}

    def tokens(self, result):
        return result["prompt_tokens"] + len(result["token_ids"])

    def write(self, results, path):
        import pyarrow as pa

        from .shards import write_parquet

        table = pa.table({
            "row": pa.array([r for r, _ in results], pa.int64()),
            "prompt_tokens": pa.array([x["prompt_tokens"] for _, x in results], pa.int32()),
            "completion": pa.array([x["completion"] for _, x in results], pa.string()),
            "token_ids": pa.array([x["token_ids"] for _, x in results], pa.list_(pa.int32())),
            "finish_reason": pa.array([x["finish_reason"] for _, x in results], pa.string()),
            "seed": pa.array([x["seed"] for _, x in results], pa.int64()),
        })
        return write_parquet(table, path), {}

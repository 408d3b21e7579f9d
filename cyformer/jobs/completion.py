"""generate: a completion for every prompt of a corpus.

Each row's prompt runs through ``model.generate`` with the job's sampling
parameters, which a row overrides with fields of its own of the same names:
max_new_tokens, temperature, top_k, top_p, repetition_penalty, stop, seed
(or any other GenerationRequest option that changes the completion).
A row without a seed gets ``seed + row`` (the job's seed, default 0), so a
sampled completion depends only on the row, never on which worker ran it.
A row whose values generate() refuses (a prompt longer than the context, a
negative temperature, ...) is skipped with generate()'s message.

Shard columns (one row per prompt, in corpus order):
    row            int64         the corpus row (0-based; JSONL line - 1)
    id             string        the row's own ``id`` field; null where it has none
    prompt_tokens  int32
    completion     string        the new text (a stop string is cut from it)
    token_ids      list<int32>   the new tokens
    finish_reason  string        "length", "eos", "stop" or "context"
    seed           int64         the seed the row was sampled with

A seed must fit the column: an integer in [0, 2**63) (a row with another is
skipped, before any work, with the reason).
"""

import dataclasses
import json

from ..model_files import DEFAULT
from ..request import GenerationRequest
from .job import Job, RowSkipped, id_column, row_id

SEED_LIMIT = 2 ** 63  # the seed column is int64

# What a row may override: every option that changes the completion (and seed).
ROW_FIELDS = tuple(f for f in GenerationRequest.fields() if f not in ("logprobs", "top_logprobs", "logprobs_mode"))
# Recorded in the manifest even at their defaults (the fields outputs have always recorded).
RECORDED = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "stop")


class Generate(Job):
    name, stem, ext, format = "generate", "completions", ".parquet", "parquet"
    default_field = "prompt"

    def __init__(self, request: GenerationRequest = None, seed=0):
        # the job's seed: a row without one is sampled with seed + row
        self.request = request if request is not None else GenerationRequest()
        self.seed = seed

    def params(self):
        # DEFAULT (the checkpoint's generation_config.json) is recorded by name
        blank = GenerationRequest()
        out = {}
        for f in ROW_FIELDS:
            v = getattr(self.request, f)
            if f == "seed" or (f not in RECORDED and v == getattr(blank, f)):
                continue
            out[f] = "checkpoint" if v is DEFAULT else (list(v) if isinstance(v, tuple) else v)
        if out["stop"] == []:
            out["stop"] = None
        return {**out, "seed": self.seed}

    @classmethod
    def from_params(cls, params):
        return cls()

    def check(self, model):
        super().check(model)
        from .. import _checks

        if not 0 <= _checks.integer("generate", "seed", self.seed) < SEED_LIMIT:
            raise ValueError(f"generate: seed must be in [0, 2**63), got {self.seed}")
        self.request.sampling(model.generation_config)  # bad values fail here, once

    def row_params(self, row):
        """The row's own sampling fields (JSON-able values only)."""
        own = {k: row.fields[k] for k in ROW_FIELDS if row.fields and row.fields.get(k) is not None}
        try:
            json.dumps(own)
        except (TypeError, ValueError):
            raise RowSkipped("its sampling fields are not plain numbers, strings or lists") from None
        seed = own.get("seed", self.seed + row.index)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise RowSkipped(f"its seed must be an integer in [0, 2**63), got {seed!r:.40}")
        ident = row_id(row)
        return own if ident is None else {**own, "id": ident}

    def process(self, model, row, text, params):
        params = params or {}
        seed = params.get("seed", self.seed + row)
        try:
            request = dataclasses.replace(
                self.request, seed=seed, **{k: v for k, v in params.items() if k not in ("seed", "id")})
            out = model.generate(text, request=request)
        except (ValueError, TypeError) as e:
            raise RowSkipped(str(e)) from None
        return {"prompt_tokens": out.stats["prompt_tokens"], "completion": str(out),
                "token_ids": list(out.token_ids), "finish_reason": out.finish_reason, "seed": int(seed),
                "id": params.get("id")}

    def tokens(self, result):
        return result["prompt_tokens"] + len(result["token_ids"])

    def write(self, results, path):
        from .shards import write_parquet

        return write_parquet(self.table(results), path), {}

    def table(self, results):
        """The shard's pyarrow Table from [(row, result)] in row order."""
        import pyarrow as pa

        return pa.table({
            "row": pa.array([r for r, _ in results], pa.int64()),
            "id": id_column(results),
            "prompt_tokens": pa.array([x["prompt_tokens"] for _, x in results], pa.int32()),
            "completion": pa.array([x["completion"] for _, x in results], pa.string()),
            "token_ids": pa.array([x["token_ids"] for _, x in results], pa.list_(pa.int32())),
            "finish_reason": pa.array([x["finish_reason"] for _, x in results], pa.string()),
            "seed": pa.array([x["seed"] for _, x in results], pa.int64()),
        })

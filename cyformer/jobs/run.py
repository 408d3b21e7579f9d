"""Running a job over a corpus: shards, resume, progress, the summary.

Rows are cut into shards by index (shard k: rows [k * shard_rows, (k + 1) *
shard_rows)), so which rows a shard holds is known before anything runs.
A shard that the manifest lists as complete is skipped; every other shard
is computed, by this process (engine "local") or by Ray actors (engine
"ray", cyformer.jobs.ray_engine), and written by ``shards.write_shard`` in
either case, so both engines give the same bytes.
"""

import dataclasses
import itertools
import os
import sys
import time

import numpy as np

from .._checks import path_arg
from ..errors import CyformerError
from .corpus import open_corpus
from .job import RowSkipped
from .shards import Manifest, write_shard

ENGINES = ("local", "ray")


@dataclasses.dataclass
class Summary:
    """What a run did.  documents/tokens/seconds count this run's work;
    skipped lists every skipped row of the output (row, where, reason)."""

    job: str
    out: str
    engine: str
    documents: int
    tokens: int
    seconds: float
    skipped: list
    shards_written: int
    shards_reused: int
    rows: int

    @property
    def tokens_per_s(self):
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self):
        """One line for a person: documents, tokens, time, tokens/s, skipped rows."""
        s = (f"{self.job}: {self.documents:,} documents, {self.tokens:,} tokens in {self.seconds:.1f} s "
             f"({self.tokens_per_s:,.0f} tokens/s, {self.engine}); {len(self.skipped)} rows skipped")
        if self.skipped:
            shown = "; ".join(f"{where}: {why}" for _, where, why in self.skipped[:3])
            s += f" ({shown}{'; ...' if len(self.skipped) > 3 else ''})"
        return s + (f"; {self.shards_written} shards written, {self.shards_reused} already done "
                    f"-> {self.out}")


def output_dir(out):
    """The output directory argument, checked before any work."""
    out = path_arg("out", out)
    if any(len(part.encode()) > 255 for part in out.split(os.sep)):
        raise ValueError(f"out: a path component is longer than 255 bytes: {out[:80]!r}...")
    return out


def model_identity(model):
    files = sorted(f for f in os.listdir(model.path) if f.endswith(".safetensors"))
    return {"path": os.path.abspath(model.path), "config": model.config.to_dict(),
            "weights": [[f, os.path.getsize(os.path.join(model.path, f))] for f in files]}


def run_row(job, model, row):
    """One row -> (result, None) or (None, skip reason)."""
    if row.error is not None:
        return None, row.error
    try:
        return job.process(model, row.index, row.text, job.row_params(row)), None
    except RowSkipped as e:
        return None, str(e)


class Progress:
    """A tqdm bar over documents with tokens/s, or nothing."""

    def __init__(self, enabled, total, name):
        self.bar = None
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.shown = 0.0
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="doc", desc=name, file=sys.stderr, dynamic_ncols=True)

    def update(self, docs, tokens):
        self.tokens += tokens
        if self.bar is None:
            return
        self.bar.update(docs)
        now = time.perf_counter()
        if now - self.shown > 0.5:
            self.shown = now
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.t0, 1e-9):,.0f} tok/s", refresh=False)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_job(job, corpus, out, model=None, *, field=None, corpus_format="auto", split=None,
            shard_rows=None, engine="local", workers=None, threads=None, address=None,
            progress=True, overwrite=False, on_shard=None, batch_docs=8):
    """Run ``job`` over ``corpus`` into the directory ``out``; -> Summary.

    model: a Model, a checkpoint directory or Hub name, or None (the bundled
    model).  engine "local" runs here with ``threads`` kernel threads;
    "ray" runs ``workers`` Ray actors of ``threads`` threads each (default 1)
    on the cluster at ``address`` (default: a local one).  on_shard(record)
    is called after each shard is written.
    """
    import cyformer
    from ..model import Model

    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r:.60}")
    out = output_dir(out)
    corpus = path_arg("corpus", corpus)
    if model is not None and not isinstance(model, (str, os.PathLike, Model)):
        raise TypeError(f"model must be a Model, a checkpoint directory or Hub name, or None (the bundled "
                        f"model), got {type(model).__name__}")
    for name, flag in (("progress", progress), ("overwrite", overwrite)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {type(flag).__name__}")
    if on_shard is not None and not callable(on_shard):
        raise TypeError(f"on_shard must be callable or None, got {type(on_shard).__name__}")
    if model is None or isinstance(model, (str, os.PathLike)):
        loaded = cyformer.load(model, threads=threads if engine == "local" else 1)
        spec = model  # Ray workers load it themselves, each from its own path or Hub cache
    else:
        loaded, spec = model, model.path
    job.check(loaded)
    corpus = open_corpus(corpus, corpus_format, field or job.default_field, split)
    shard_rows = job.default_shard_rows if shard_rows is None else shard_rows
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1:
        raise ValueError(f"shard_rows must be a positive integer, got {shard_rows!r}")
    identity = {"job": job.name, "stem": job.stem, "format": job.format, "params": job.params(),
                "model": model_identity(loaded), "corpus": {**corpus.describe(),
                                                            "files": corpus.fingerprint()},
                "shard_rows": shard_rows, **job.identity_extra()}
    try:
        manifest = Manifest.start(out, identity, overwrite=bool(overwrite))
    except OSError as e:
        raise CyformerError(f"cannot write the output directory {out[:200]!r}: {e.strerror or e}") from None
    done_before = set(manifest.shards)
    bar = Progress(progress, corpus.count(), job.name)
    t0 = time.perf_counter()
    counts = {"documents": 0, "tokens": 0, "written": 0}

    def finished(record):
        manifest.add(record)
        counts["documents"] += record["documents"]
        counts["tokens"] += record["tokens"]
        counts["written"] += 1
        if on_shard is not None:
            on_shard(record)

    shards = ((k, list(rows)) for k, rows in
              itertools.groupby(corpus.rows(), key=lambda r: r.index // shard_rows))
    n_rows = 0
    try:
        if engine == "local":
            for k, rows in shards:
                n_rows = rows[-1].index + 1
                if k in manifest.shards:
                    bar.update(len(rows), 0)
                    continue
                results, skipped = [], []
                for row in rows:
                    result, why = run_row(job, loaded, row)
                    if why is None:
                        results.append((row.index, result))
                        bar.update(1, job.tokens(result))
                    else:
                        skipped.append((row.index, row.where, why))
                        bar.update(1, 0)
                finished(write_shard(job, out, k, k * shard_rows, len(rows), results, skipped))
        else:
            from .ray_engine import run_on_ray

            todo = []
            for k, rows in shards:
                n_rows = rows[-1].index + 1
                if k in manifest.shards:
                    bar.update(len(rows), 0)
                else:
                    todo.append((k, rows))
            run_on_ray(job, spec, todo, out, shard_rows,
                       workers=workers, threads=threads, address=address, finished=finished, bar=bar,
                       batch_docs=batch_docs)
    except KeyboardInterrupt:
        bar.close()
        print(f"\n[cyformer] interrupted: {len(manifest.shards)} shards of {out} are complete; "
              "run the same command again to resume", file=sys.stderr)
        raise
    bar.close()
    manifest.finish(n_rows)
    skipped = [tuple(s) for k in sorted(manifest.shards) for s in manifest.shards[k]["skipped"]]
    return Summary(job.name, out, engine, counts["documents"], counts["tokens"], time.perf_counter() - t0,
                   skipped, counts["written"], len(done_before), n_rows)

"""Jobs over whole corpora: score, generate, collect; in this process or on Ray.

    from cyformer import jobs

    jobs.score("test.jsonl", "out/scores")                  # log-likelihood, perplexity per document
    jobs.generate("prompts.jsonl", "out/gen", max_new_tokens=64)
    jobs.collect("train.jsonl", "out/acts", hooks=["blocks.1.hook_resid_post"])
    acts = jobs.open("out/acts", mmap=True)["blocks.1.hook_resid_post"]    # [tokens, d_model]

Every job reads a corpus (JSONL, Parquet, .txt files, a saved ``datasets``
dataset: cyformer.jobs.corpus), writes shards of ``shard_rows`` corpus rows
plus a manifest (cyformer.jobs.shards), and returns a Summary.  The output
depends only on the corpus, the model and the job's parameters: the same
bytes at any thread or worker count, on either engine, after any number of
interruptions (rerun the same call to resume; complete shards are kept).
Rows that cannot be used are skipped and listed with where they are, never
an error.  ``engine="ray"`` runs on Ray Data (cyformer.jobs.ray_engine).

Common keyword arguments of score/generate/collect:
    model          a Model, a checkpoint directory or Hub name; None: the bundled model
    field          the text's key or column (default "text"; generate: "prompt")
    corpus_format  "auto", "jsonl", "parquet", "text" or "datasets"; split: a datasets split
    shard_rows     rows per shard (default 1000; collect: 64)
    engine         "local" (default) or "ray"; workers, threads, address (Ray's cluster)
    progress       a progress bar on standard error (needs tqdm)
    overwrite      replace another job's output in ``out`` instead of refusing
    on_shard       called with each shard's manifest record once it is written
"""

from .activations import Collect
from .corpus import Corpus, CorpusError, Row, open_corpus
from .completion import Generate
from .run import Summary, run_job
from .scoring import Score
from .shards import JobOutput, JobOutputError, RowView, open_output

JOBS = {job.name: job for job in (Score, Generate, Collect)}


def open(out, mmap=False):  # noqa: A001  jobs.open, as the docs spell it
    """Open a job's output directory (see JobOutput)."""
    return open_output(out, mmap=mmap, jobs=JOBS)

__all__ = ["score", "generate", "collect", "open", "Summary", "JobOutput", "RowView", "Corpus",
           "CorpusError", "JobOutputError", "Row", "open_corpus"]


def score(corpus, out, model=None, *, stride=None, per_token=False, **run):
    """Log-likelihood, token count and perplexity of every document.

    stride: how far each window of a document longer than the context moves
    (default n_positions // 2; see cyformer.jobs.scoring); per_token: also
    store every token id and its log-probability.  -> Summary.
    """
    return run_job(Score(stride, per_token), corpus, out, model, **run)


def generate(corpus, out, model=None, *, seed=0, request=None, **options):
    """A completion for every prompt (the ``prompt`` field by default).

    Generation options as for Model.generate (GenerationRequest's fields as
    keywords, or ``request``; not given: the checkpoint's defaults, and
    max_new_tokens 64); the other keywords are the common ones above.  A
    row's own fields of the same names override them, and a row without a
    seed uses seed + its row index.  -> Summary.
    """
    from ..request import GenerationRequest

    mine = {k: options.pop(k) for k in list(options) if k in GenerationRequest.fields()}
    job = Generate(GenerationRequest.build(request, **mine), seed)
    return run_job(job, corpus, out, model, **options)


def collect(corpus, out, model=None, *, hooks, dtype="float32", save_as="safetensors", max_tokens=None,
            **run):
    """Activations at ``hooks`` (hook names, e.g. "blocks.0.hook_resid_post")
    for every token, with token ids, document rows and positions.

    dtype "float32" or "float16"; save_as "safetensors" or "npy"; documents
    longer than max_tokens (default: the context) are truncated.  -> Summary.
    """
    return run_job(Collect(hooks, dtype, save_as, max_tokens), corpus, out, model, **run)

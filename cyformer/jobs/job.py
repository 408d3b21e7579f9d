"""What every job is: a per-document computation plus a shard writer.

A Job is a small picklable object (its parameters), so a Ray worker gets
the very object the driver checked.  Both engines call the same methods:

    job.check(model)                 validate the parameters against the model, once
    job.row_params(row)              what a row carries besides its text (JSON-able)
    job.process(model, row, text, params) -> result    one document
    job.tokens(result)               tokens it ran through the model (progress)
    job.write(results, path)         one shard from [(row, result), ...] in row order

A row's own ``id`` field (JSONL key or column), when it has one, travels in
its params and becomes the ``id`` column of a Parquet output (as text:
JSON numbers in their decimal spelling), so results join back to the input
on the corpus's key as well as on ``row``.
"""

import json


from ..errors import CyformerError


class RowSkipped(Exception):
    """A document the job cannot run (it becomes a skipped row with this reason)."""


class Job:
    name = None            # "score", "generate", "collect"
    stem = None            # shard file names: STEM-00000.EXT
    ext = None             # ".parquet", ".safetensors", "" (a directory of .npy)
    format = None          # "parquet", "safetensors" or "npy"
    default_field = "text"
    default_shard_rows = 1000

    def params(self):
        """The parameters that decide the output (recorded in the manifest)."""
        raise NotImplementedError

    @classmethod
    def from_params(cls, params):
        """The job whose ``params()`` were ``params`` (as a manifest records them)."""
        return cls()

    def check(self, model):
        """Validate the parameters against the model and that what the output
        needs is installed, before any work starts."""
        if self.format == "parquet":
            try:
                import pyarrow  # noqa: F401
            except ImportError:
                raise CyformerError(f"{self.name}: Parquet output needs pyarrow: "
                                    "pip install 'cyformer[jobs]' (or pyarrow)") from None
        if not model.tokenizer.available:
            raise CyformerError(f"{self.name}: the model at {model.path} has no tokenizer.json; "
                                "corpus jobs read text")

    def identity_extra(self):
        """More of the manifest's identity (e.g. the arrays a shard holds)."""
        return {}

    def row_params(self, row):
        """JSON-able values of the row that the job uses besides its text
        (here: its ``id``, see the module docstring)."""
        ident = row_id(row)
        return None if ident is None else {"id": ident}

    def process(self, model, row, text, params):
        raise NotImplementedError

    def tokens(self, result):
        raise NotImplementedError

    def write(self, results, path):
        """-> (bytes written, extra fields for the shard's manifest record)."""
        raise NotImplementedError


def row_id(row):
    """The row's own ``id`` field as text, or None."""
    value = (row.fields or {}).get("id")
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None  # a lone surrogate: no Parquet string can hold it
        return value
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)


def id_column(results):
    """The ``id`` column of a Parquet shard from [(row, result)]."""
    import pyarrow as pa

    return pa.array([x.get("id") for _, x in results], pa.string())


def encode(model, text):
    """Token ids of a document, as a prompt is encoded (bos where the tokenizer adds one)."""
    ids = model.tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise RowSkipped("the text encodes to no tokens")
    return ids

"""What every job is: a per-document computation plus a shard writer.

A Job is a small picklable object (its parameters), so a Ray worker gets
the very object the driver checked.  Both engines call the same methods:

    job.check(model)                 validate the parameters against the model, once
    job.row_params(row)              what a row carries besides its text (JSON-able)
    job.process(model, row, text, params) -> result    one document
    job.tokens(result)               tokens it ran through the model (progress)
    job.write(results, path)         one shard from [(row, result), ...] in row order
"""

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

    def check(self, model):
        if not model.tokenizer.available:
            raise CyformerError(f"{self.name}: the model at {model.path} has no tokenizer.json; "
                                "corpus jobs read text")

    def identity_extra(self):
        """More of the manifest's identity (e.g. the arrays a shard holds)."""
        return {}

    def row_params(self, row):
        return None

    def process(self, model, row, text, params):
        raise NotImplementedError

    def tokens(self, result):
        raise NotImplementedError

    def write(self, results, path):
        """-> (bytes written, extra fields for the shard's manifest record)."""
        raise NotImplementedError


def encode(model, text):
    """Token ids of a document, as a prompt is encoded (bos where the tokenizer adds one)."""
    ids = model.tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise RowSkipped("the text encodes to no tokens")
    return ids

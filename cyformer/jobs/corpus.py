"""Corpora: the documents a job runs over, one ``Row`` per input row, in order.

Formats (``format="auto"`` picks one from the path):

    jsonl      one JSON object per line; the text is ``obj[field]``        *.jsonl, *.json
    parquet    one row per record; the text is the column ``field``        *.parquet
    text       a .txt file is one document; a directory of .txt files is
               one document per file, in sorted name order
    datasets   a Hugging Face ``datasets`` dataset saved with save_to_disk
               (a directory with state.json or dataset_dict.json)

A row's index (0-based, counting every row, malformed ones too) is the
document's identity in every output; for JSONL it is the line number minus
one.  A row that cannot be used (not UTF-8, not JSON, no such field, not a
string, empty) becomes a Row with ``error`` set and no text: jobs count and
report it, and it never stops the run.
"""

import dataclasses
import glob
import json
import os

from .._checks import path_arg
from ..errors import CyformerError

FORMATS = ("jsonl", "parquet", "text", "datasets")


class CorpusError(CyformerError):
    """The corpus cannot be read at all (missing, unknown format, no such split)."""


@dataclasses.dataclass
class Row:
    """One input row.  where: how to find it in the input ("line 12", "row 12",
    a file name); fields: the row's other values (JSON object or record)."""

    index: int
    where: str
    text: str = None
    fields: dict = None
    error: str = None


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A corpus on disk: path, format, the text field, and the split (datasets)."""

    path: str
    format: str
    field: str = "text"
    split: str = None

    def rows(self):
        """Every row in order (a generator; the file is read as it goes)."""
        return _READERS[self.format](self)

    def fingerprint(self):
        """Sizes and modification times of the files read: a resumed job
        checks that its corpus has not changed under it."""
        files = _files(self.path)
        return [[os.path.relpath(f, self.path) if os.path.isdir(self.path) else os.path.basename(f),
                 os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files]

    def count(self):
        """The number of rows, read cheaply (line count, Parquet metadata, ...)."""
        if self.format == "jsonl":
            n, last = 0, b"\n"
            with open(self.path, "rb") as f:
                while chunk := f.read(1 << 20):
                    n += chunk.count(b"\n")
                    last = chunk[-1:]
            return n + (last != b"\n")
        if self.format == "parquet":
            import pyarrow.parquet as pq
            return pq.ParquetFile(self.path).metadata.num_rows
        if self.format == "text":
            return 1 if os.path.isfile(self.path) else len(glob.glob(os.path.join(self.path, "*.txt")))
        return len(_load_dataset(self))

    def describe(self):
        return {"path": os.path.abspath(self.path), "format": self.format, "field": self.field,
                "split": self.split}


def open_corpus(path, format="auto", field="text", split=None):
    """A Corpus for ``path``; format "auto" goes by the suffix or the directory's contents."""

    path = path_arg("corpus", path)
    if not isinstance(format, str):
        raise TypeError(f"format must be one of auto, {', '.join(FORMATS)}, got {type(format).__name__}")
    if split is not None and not isinstance(split, str):
        raise TypeError(f"split must be a split's name (str) or None, got {type(split).__name__}")
    if not os.path.exists(path):
        raise CorpusError(f"{path}: corpus not found")
    if format == "auto":
        format = _detect(path)
    if format not in FORMATS:
        raise CorpusError(f"unknown corpus format {format!r}; expected one of {', '.join(FORMATS)}")
    if not isinstance(field, str) or not field:
        raise CorpusError(f"field must be a non-empty column or key name, got {field!r}")
    return Corpus(path, format, field, split)


def _detect(path):
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json")):
            return "datasets"
        if glob.glob(os.path.join(path, "*.txt")):
            return "text"
        raise CorpusError(f"{path}: a directory with neither .txt files nor a saved datasets "
                          "dataset (state.json or dataset_dict.json)")
    lower = path.lower()
    for suffix, fmt in ((".jsonl", "jsonl"), (".json", "jsonl"), (".ndjson", "jsonl"),
                        (".parquet", "parquet"), (".txt", "text")):
        if lower.endswith(suffix):
            return fmt
    raise CorpusError(f"{path}: cannot tell the format from the name; pass format= "
                      f"({', '.join(FORMATS)})")


def _files(path):
    if os.path.isfile(path):
        return [path]
    return sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(f))


def _text_of(value, field):
    """The usable text in a field's value, or (None, why not)."""
    if value is None:
        return None, f"no field {field!r}"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return None, f"field {field!r} is not UTF-8 (byte {e.start})"
    if not isinstance(value, str):
        return None, f"field {field!r} is not a string (got {type(value).__name__})"
    if not value:
        return None, f"field {field!r} is empty"
    try:  # JSON can spell lone surrogates (\ud800), which no tokenizer takes
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None, f"field {field!r} is not valid Unicode (a lone surrogate)"
    return value, None


def _record_row(index, where, record, field):
    if not isinstance(record, dict):
        return Row(index, where, error=f"not a JSON object (got {type(record).__name__})")
    if field not in record:
        return Row(index, where, error=f"no field {field!r}")
    text, error = _text_of(record[field], field)
    if error:
        return Row(index, where, error=error)
    return Row(index, where, text, {k: v for k, v in record.items() if k != field})


def _jsonl_rows(corpus):
    with open(corpus.path, "rb") as f:
        for i, raw in enumerate(f):
            where = f"line {i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(i, where, error=f"not UTF-8 (byte {e.start})")
                continue
            if not line.strip():
                yield Row(i, where, error="empty line")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield Row(i, where, error=f"not JSON ({e.msg} at column {e.colno})")
                continue
            yield _record_row(i, where, record, corpus.field)


def _parquet_rows(corpus):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CorpusError("Parquet corpora need pyarrow: pip install 'cyformer[jobs]'") from None
    pf = pq.ParquetFile(corpus.path)
    if corpus.field not in pf.schema_arrow.names:
        raise CorpusError(f"{corpus.path}: no column {corpus.field!r} (columns: "
                          f"{', '.join(pf.schema_arrow.names)})")
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            yield _record_row(i, f"row {i}", record, corpus.field)
            i += 1


def _text_rows(corpus):
    paths = _files(corpus.path) if os.path.isfile(corpus.path) else sorted(
        glob.glob(os.path.join(corpus.path, "*.txt")))
    for i, p in enumerate(paths):
        where = os.path.basename(p)
        with open(p, "rb") as f:
            text, error = _text_of(f.read(), "file")
        yield Row(i, where, text, {}) if error is None else Row(i, where, error=error.replace(
            "field 'file' is", "the file is"))


def _load_dataset(corpus):
    try:
        import datasets
    except ImportError:
        raise CorpusError("datasets corpora need the datasets package: pip install datasets") from None
    ds = datasets.load_from_disk(corpus.path)
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        split = corpus.split if corpus.split is not None else (splits[0] if len(splits) == 1 else None)
        if split not in ds:
            raise CorpusError(f"{corpus.path}: choose a split with split= (it has: {', '.join(splits)})")
        ds = ds[split]
    if corpus.field not in ds.column_names:
        raise CorpusError(f"{corpus.path}: no column {corpus.field!r} (columns: "
                          f"{', '.join(ds.column_names)})")
    return ds


def _datasets_rows(corpus):
    ds = _load_dataset(corpus)
    i = 0
    for batch in ds.iter(batch_size=1024):
        names = list(batch)
        for values in zip(*(batch[n] for n in names)):
            yield _record_row(i, f"row {i}", dict(zip(names, values)), corpus.field)
            i += 1


_READERS = {"jsonl": _jsonl_rows, "parquet": _parquet_rows, "text": _text_rows,
            "datasets": _datasets_rows}

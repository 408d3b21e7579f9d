"""Shard files and the manifest: how a job's output sits on disk, and ``open``.

An output directory holds ``_manifest.json`` and one file (or, for .npy
activations, one directory) per shard: ``scores-00000.parquet``,
``completions-00000.parquet``, ``activations-00000.safetensors`` or
``activations-00000/`` of ``NAME.npy`` files.  Shard k holds the results of
corpus rows [k * shard_rows, (k + 1) * shard_rows), in row order, whoever
computed them.  The manifest's name starts with ``_`` because Parquet
readers (pandas, pyarrow.dataset, Spark) skip such files, so
``pd.read_parquet(out)`` reads the shards alone.

Every shard is written under a ``.tmp`` name and renamed when complete; the
manifest (also replaced atomically) lists the shards that are done with
their sizes, so a shard file without a manifest entry, or with another size,
is redone on the next run, and a stray ``.tmp`` is removed.  A job only ever
deletes names it writes itself (``owned``: its shard names, their ``.tmp``
names and the manifest's), never another file of the directory, and only
reads shard files named so, inside the directory.  Nothing in a shard or in
the manifest depends on time, thread or worker counts, so the same job gives
the same bytes however it ran.
"""

import json
import os
import re
import shutil

import numpy as np

from .._checks import path_arg
from ..errors import CyformerError

MANIFEST = "_manifest.json"
OLD_MANIFEST = "manifest.json"  # before 0.x: read, and replaced by MANIFEST on the next run
MANIFEST_VERSION = 1
TMP = ".tmp"
SHARD_EXTS = (".parquet", ".safetensors", "")


class JobOutputError(CyformerError):
    """An output directory is not a job's output, or belongs to a different job."""


class MissingShard(JobOutputError, KeyError):
    """JobOutput.shard(k) for a shard that is not complete."""

    def __str__(self):  # KeyError would show the message in quotes
        return str(self.args[0])


def shard_path(out, stem, index, ext):
    """ext "" names a directory shard (.npy activations)."""
    return os.path.join(out, f"{stem}-{index:05d}{ext}")


def owned(name, stem=None):
    """Whether ``name`` (a directory entry) is one a job writes: a shard
    ``STEM-NNNNN[.EXT]`` of the given stem (any job's when None), the
    manifest, or one of these with ``.tmp``.  Only such names are ever
    removed or read as shards."""
    base = name[:-len(TMP)] if name.endswith(TMP) else name
    if base in (MANIFEST, OLD_MANIFEST):
        return True
    stems = re.escape(stem) if stem is not None else "(scores|completions|activations)"
    exts = "|".join(re.escape(e) for e in SHARD_EXTS)
    return re.fullmatch(rf"{stems}-\d{{5}}({exts})", base) is not None


def _manifest_path(out):
    """The manifest of ``out``: the current name, else the old one where only it exists."""
    path = os.path.join(out, MANIFEST)
    old = os.path.join(out, OLD_MANIFEST)
    return old if not os.path.exists(path) and os.path.isfile(old) else path


def _path_bytes(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path)))
    return os.path.getsize(path)


def _remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _commit(tmp, path):
    """Put the finished ``tmp`` in place of ``path`` (a file or a directory)."""
    if os.path.isdir(tmp):  # os.replace cannot replace a directory with one
        _remove(path)
        os.rename(tmp, path)
    else:
        os.replace(tmp, path)
    return _path_bytes(path)


# -- writers ---------------------------------------------------------------

def write_parquet(table, path):
    """Write a pyarrow Table as one Parquet file, atomically; -> bytes written.
    One row group, zstd, no pandas metadata: the bytes depend on the table only."""
    import pyarrow.parquet as pq

    tmp = path + TMP
    _remove(tmp)
    pq.write_table(table, tmp, compression="zstd", row_group_size=max(1, table.num_rows))
    return _commit(tmp, path)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64}


def write_arrays(arrays, path, fmt):
    """Write name -> array as one safetensors file or a directory of .npy
    files, atomically; -> bytes written."""
    tmp = path + TMP
    _remove(tmp)
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file(arrays, tmp)
    else:
        os.makedirs(tmp)
        for name, a in arrays.items():
            np.save(os.path.join(tmp, name + ".npy"), a, allow_pickle=False)
    return _commit(tmp, path)


def read_arrays(path, fmt, mmap):
    """name -> array of one shard; memory-mapped (read-only) when mmap."""
    if fmt == "npy":
        return {f[:-4]: np.load(os.path.join(path, f), mmap_mode="r" if mmap else None, allow_pickle=False)
                for f in sorted(os.listdir(path)) if f.endswith(".npy")}
    if not mmap:
        from safetensors.numpy import load_file

        return load_file(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = np.dtype(_ST_DTYPES[info["dtype"]]), tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end == begin:  # an empty tensor: nothing to map
            out[name] = np.empty(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=8 + n + begin, shape=shape)
    return out


# -- the manifest ------------------------------------------------------------

class Manifest:
    """manifest.json of one output directory.

    ``identity`` says what the output is of (job, parameters, model, corpus,
    shard size, file format); a directory holding another identity is
    refused rather than mixed.  ``shards`` maps index -> record for the
    shards that are complete.
    """

    def __init__(self, out, identity):
        self.out = out
        self.path = os.path.join(out, MANIFEST)
        self.identity = identity
        self.shards = {}
        self.complete = False
        self.rows = None

    @classmethod
    def start(cls, out, identity, overwrite=False):
        """Open ``out`` for this job: a fresh manifest, or the existing one
        when it is the same job (its complete shards are kept if their files
        are still there with the recorded size)."""
        os.makedirs(out, exist_ok=True)
        identity = json.loads(json.dumps(identity))  # tuples -> lists, as the file holds them
        m = cls(out, identity)
        found = _manifest_path(out)
        old = read_manifest(found) if os.path.exists(found) else None
        stem = identity["stem"]
        if old is not None and not overwrite:
            if old["identity"] != identity:
                diff = sorted(k for k in set(identity) | set(old["identity"])
                              if identity.get(k) != old["identity"].get(k))
                raise JobOutputError(
                    f"{out} holds the output of a different job (differs in: {', '.join(diff)}); "
                    "choose another output directory, or overwrite it (overwrite=True, --overwrite)")
            for rec in old["shards"]:
                p = shard_file(out, rec, stem)
                if os.path.exists(p) and _path_bytes(p) == rec["bytes"]:
                    m.shards[rec["index"]] = rec
        elif old is not None:
            for name in os.listdir(out):
                if owned(name, stem) and name not in (MANIFEST, OLD_MANIFEST):
                    _remove(os.path.join(out, name))
        for name in os.listdir(out):  # leftovers of an interrupted write: only our own names
            if name.endswith(TMP) and owned(name, stem):
                _remove(os.path.join(out, name))
        m.save()
        if found != m.path:
            os.remove(found)  # the old name, now replaced
        return m

    def add(self, record):
        self.shards[record["index"]] = record
        self.save()

    def finish(self, rows):
        self.rows = rows
        self.complete = True
        self.save()

    def to_dict(self):
        return {"version": MANIFEST_VERSION, "identity": self.identity, "complete": self.complete,
                "rows": self.rows, "shards": [self.shards[k] for k in sorted(self.shards)]}

    def save(self):
        tmp = self.path + TMP
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")
        os.replace(tmp, self.path)


def read_manifest(path):
    """A manifest file as a dict, its shape checked: an object with an
    ``identity`` object and a ``shards`` list of records that each name
    their shard (``index``, ``file``, ``bytes``)."""
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError) as e:
        raise JobOutputError(f"{path}: not a readable job manifest ({e})") from None

    def bad(why):
        return JobOutputError(f"{path}: not a job manifest ({why})")
    if not isinstance(m, dict):
        raise bad(f"a JSON {type(m).__name__}, not an object")
    ident = m.get("identity")
    if not isinstance(ident, dict) or not all(isinstance(ident.get(k), str) for k in ("job", "stem", "format")):
        raise bad("no identity object with job, stem and format")
    if not isinstance(m.get("shards", []), list):
        raise bad("shards is not a list")
    m.setdefault("shards", [])
    for rec in m["shards"]:
        if not isinstance(rec, dict):
            raise bad("a shard record is not an object")
        for key, kind in (("index", int), ("file", str), ("bytes", int)):
            if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
                raise bad(f"a shard record without an integer index, a file name and a byte count: {rec!r:.200}")
    return m


def shard_file(out, rec, stem):
    """The path of a manifest record's shard, which must be one of the job's
    own shard names directly inside ``out`` (never ``../x`` or an absolute path)."""
    name = rec["file"]
    if os.path.basename(name) != name or name.endswith(TMP) or not owned(name, stem) \
            or name in (MANIFEST, OLD_MANIFEST):
        raise JobOutputError(f"{os.path.join(out, MANIFEST)}: shard record names {name!r:.200}, "
                             f"which is not a {stem} shard inside the output directory")
    return os.path.join(out, name)


# -- reading an output back ----------------------------------------------------

class RowView:
    """Rows of one array across every shard, memory-mapped: ``view[i]``,
    ``view[a:b]`` and ``np.asarray(view)`` read only what they touch."""

    def __init__(self, parts):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])
        first = parts[0]
        self.shape = (int(self.starts[-1]), *first.shape[1:])
        self.dtype = first.dtype

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"row {key} out of range for {len(self)} rows")
            k = int(np.searchsorted(self.starts, i, side="right")) - 1
            return np.asarray(self.parts[k][i - self.starts[k]])
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            pieces = []
            for k, p in enumerate(self.parts):
                lo, hi = max(start, self.starts[k]), min(stop, self.starts[k + 1])
                if lo < hi:
                    pieces.append(p[lo - self.starts[k]:hi - self.starts[k]])
            return np.concatenate(pieces) if pieces else np.empty((0, *self.shape[1:]), self.dtype)
        idx = np.asarray(key)
        return np.stack([self[int(i)] for i in idx.ravel()]).reshape(*idx.shape, *self.shape[1:]) \
            if idx.size else np.empty((*idx.shape, *self.shape[1:]), self.dtype)

    def __array__(self, dtype=None, copy=None):
        a = self[:]
        return a if dtype is None else a.astype(dtype)

    def __repr__(self):
        return f"<RowView {self.shape} {self.dtype} over {len(self.parts)} shards>"


class JobOutput:
    """A finished (or partial) job's output directory, as ``open`` returns it.

    ``manifest`` (dict), ``job`` ("score", "generate", "collect"),
    ``complete``, ``skipped`` (the rows no output was made for: (row, where,
    reason)), ``names`` (columns or arrays), ``out[name]`` (a NumPy array over
    every shard in row order; for activations opened with mmap=True, a
    RowView), ``shard(k)`` and, for Parquet outputs, ``table()``.
    """

    def __init__(self, out, mmap=False, jobs=None):
        self.jobs = jobs  # job name -> job class (cyformer.jobs.JOBS): an empty table's columns
        path = _manifest_path(out)
        if not os.path.exists(path):
            raise JobOutputError(f"{out}: no {MANIFEST}; not the output of a cyformer job")
        self.dir = out
        self.manifest = read_manifest(path)
        ident = self.manifest["identity"]
        self.job = ident["job"]
        self.format = ident["format"]
        self.mmap = mmap
        self.complete = bool(self.manifest.get("complete"))
        self._records = self.manifest["shards"]
        for rec in self._records:
            shard_file(out, rec, ident["stem"])
        self._cache = {}

    def __repr__(self):
        return (f"<cyformer.jobs output {self.job!r} in {self.dir}: {len(self._records)} shards, "
                f"{self.documents} documents, {'complete' if self.complete else 'incomplete'}>")

    @property
    def documents(self):
        return sum(r.get("documents", 0) for r in self._records)

    @property
    def tokens(self):
        return sum(r.get("tokens", 0) for r in self._records)

    @property
    def skipped(self):
        return [tuple(s) for r in self._records for s in r.get("skipped", [])]

    @property
    def names(self):
        if self.format == "parquet":
            return list(self.table().column_names)
        return list(self.manifest["identity"]["arrays"])

    def _file(self, rec):
        return shard_file(self.dir, rec, self.manifest["identity"]["stem"])

    def shard(self, k):
        """Shard k's contents: a pyarrow Table (Parquet) or name -> array."""
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"shard: k must be a shard index (int), got {type(k).__name__}")
        rec = next((r for r in self._records if r["index"] == k), None)
        if rec is None:
            raise MissingShard(f"shard {k} is not in {self.dir} (complete shards: "
                           f"{[r['index'] for r in self._records][:10]}...)")
        if self.format == "parquet":
            import pyarrow.parquet as pq
            return pq.read_table(self._file(rec))
        return read_arrays(self._file(rec), self.format, self.mmap)

    def table(self):
        """Every shard of a score or generate job as one pyarrow Table."""
        if self.format != "parquet":
            raise JobOutputError(f"a {self.job} output holds arrays, not a table; use out[name]")
        if "table" not in self._cache:
            import pyarrow as pa
            import pyarrow.parquet as pq
            tables = [pq.read_table(self._file(r)) for r in self._records]
            # no shards (an empty corpus): the job's columns with no rows
            self._cache["table"] = pa.concat_tables(tables) if tables else _empty_table(self.manifest, self.jobs or {})
        return self._cache["table"]

    def __getitem__(self, name):
        if self.format == "parquet":
            table = self.table()
            if name not in table.column_names:
                raise KeyError(f"no column {name!r}; columns: {', '.join(table.column_names)}")
            col = table.column(name)
            return col.to_numpy(zero_copy_only=False)
        if name not in self.manifest["identity"]["arrays"]:
            raise KeyError(f"no array {name!r}; arrays: {', '.join(self.manifest['identity']['arrays'])}")
        parts = [self.shard(r["index"])[name] for r in self._records]
        if not parts:
            spec = self.manifest["identity"]["arrays"][name]
            return np.empty((0, *spec["shape"]), dtype=spec["dtype"])
        return RowView(parts) if self.mmap else np.concatenate(parts)


def _empty_table(manifest, jobs):
    """The table of a Parquet job's output that has no rows."""
    ident = manifest["identity"]
    job = jobs.get(ident["job"])
    if job is None:
        raise JobOutputError(f"unknown job {ident['job']!r:.100} in the manifest")
    return job.from_params(ident.get("params") or {}).table([])


def open_output(out, mmap=False, jobs=None):
    """Open a job's output directory (see JobOutput)."""

    if not isinstance(mmap, (bool, np.bool_)):
        raise TypeError(f"open: mmap must be True or False, got {type(mmap).__name__}")
    return JobOutput(path_arg("out", out), mmap=bool(mmap), jobs=jobs)


def write_shard(job, out, index, first_row, n_rows, results, skipped):
    """Write shard ``index`` from its results [(row, result)] (any order) and
    skipped rows; -> its manifest record."""
    results = sorted(results, key=lambda item: item[0])
    skipped = sorted(skipped)
    path = shard_path(out, job.stem, index, job.ext)
    nbytes, extra = job.write(results, path)
    return {"index": index, "file": os.path.basename(path), "rows": [first_row, first_row + n_rows],
            "documents": len(results), "tokens": sum(job.tokens(r) for _, r in results),
            "skipped": [list(s) for s in skipped], "bytes": nbytes, **extra}

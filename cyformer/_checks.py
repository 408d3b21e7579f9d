"""Argument validation for every Python-facing kernel wrapper.

The compiled kernels run with bounds checks off, so these checks are the only
guard between a caller and memory corruption: each one raises ValueError with
a message that names the function and the offending argument.
"""

import functools
import numbers
import os

import numpy as np

from . import _cores, _openmp

F32 = np.dtype(np.float32)


def f32(fn, name, a, ndim, writable=False):
    """a must be a C-contiguous float32 ndarray with ndim dimensions (None: any)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{fn}: {name} must be a numpy.ndarray of float32, got {type(a).__name__}")
    if a.dtype != F32:
        raise ValueError(f"{fn}: {name} must have dtype float32, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{fn}: {name} must be C-contiguous (np.ascontiguousarray makes a copy that is)")
    if writable and not a.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only but is written to")
    return a


def shape(fn, name, a, expected):
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{fn}: {name} must have shape {tuple(expected)}, got {a.shape}")


def same_dim(fn, name, a, axis, expected, what):
    if a.shape[axis] != expected:
        raise ValueError(f"{fn}: {name}.shape[{axis}] must equal {what} ({expected}), got shape {a.shape}")


def no_overlap(fn, name, arr, /, **inputs):
    for other_name, other in inputs.items():
        if other is not None and np.may_share_memory(arr, other):
            raise ValueError(f"{fn}: {name} must not share memory with {other_name}")


def integer(fn, name, value):
    if type(value) is int:  # the common case, without the slower ABC check below
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{fn}: {name} must be an integer, got {value!r}")
    return int(value)


def token_ids(fn, name, ids, vocab_size, ndim=None):
    """Token ids as a C-contiguous int64 array, every id in [0, vocab_size)."""
    if isinstance(ids, np.ma.MaskedArray):
        # its min() and max() skip masked entries, which the kernels would read
        raise ValueError(f"{fn}: {name} is a masked array; pass the ids to use "
                         "(ids.compressed() or ids.filled(token))")
    if isinstance(ids, np.ndarray):
        arr = np.asarray(ids)  # a subclass's data as a plain array: what is checked is what is used
    elif isinstance(ids, (str, bytes)):
        raise ValueError(f"{fn}: {name} must be integer token ids, got {type(ids).__name__}; {fn} takes "
                         "token ids: use model.encode(text) (generate and stream take text as it is)")
    else:
        try:
            arr = np.asarray(ids)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{fn}: {name} must be integer token ids: {e}") from None
        except MemoryError:
            raise ValueError(f"{fn}: {name} holds more token ids than fit in memory") from None
        if arr.size == 0:  # an empty list has no dtype of its own
            arr = arr.astype(np.int64)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{fn}: {name} must be integer token ids, got dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{fn}: {name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{fn}: {name} contains token id {bad}, outside [0, {vocab_size})")
    return np.ascontiguousarray(arr, dtype=np.int64)


def text(fn, name, value):
    """value must be a str of valid Unicode: the tokenizer reads UTF-8, which
    has no lone surrogates (what undecodable bytes become in sys.argv and in
    files read with errors="surrogateescape")."""
    if not isinstance(value, str):
        raise ValueError(f"{fn}: {name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(value[e.start])
        what = (f"the undecodable byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF
                else f"a lone surrogate U+{c:04X}")
        raise ValueError(f"{fn}: {name} holds {what} at index {e.start}; text must be valid "
                         "Unicode (UTF-8 when read as bytes)") from None
    return value


available_cores = _cores.available


def default_threads():
    """OMP_NUM_THREADS when set, else the cores in this process's affinity mask."""
    return _default_threads(os.environ.get("OMP_NUM_THREADS", ""))


@functools.lru_cache(maxsize=8)
def _default_threads(omp_env):
    # cached per value of OMP_NUM_THREADS: reading the affinity mask is a system call
    env = omp_env.split(",")[0].strip()
    if env:
        try:
            n = int(env)
            if n >= 1:
                return min(n, MAX_THREADS)
        except ValueError:
            pass
    return available_cores()


# More OpenMP threads than this is a mistake, and libgomp can crash on them.
MAX_THREADS = 1024


def threads(fn, n):
    """The team a kernel call runs with: n checked (None: the default), capped
    by the cores other processes leave free (cyformer._cores); 1 in a process
    forked when OpenMP's worker threads could not be ended (cyformer._openmp)."""
    if n is None:
        n = default_threads()
    elif not (type(n) is int and 1 <= n <= MAX_THREADS):
        n = integer(fn, "threads", n)
        if not 1 <= n <= MAX_THREADS:
            raise ValueError(f"{fn}: threads must be in [1, {MAX_THREADS}], got {n}")
    return 1 if _openmp.one_thread else _cores.team(n)


def check_ids(ids, cfg, fn="forward"):
    """Token ids -> (int64 array [B, T], had_batch_axis), validated against cfg."""
    arr = token_ids(fn, "ids", ids, cfg.vocab_size)
    if arr.ndim not in (1, 2):
        raise ValueError(f"{fn}: ids must be 1-D [T] or 2-D [B, T], got shape {arr.shape}")
    batched = arr.ndim == 2
    if arr.size == 0:
        raise ValueError(f"{fn}: ids must hold at least one token, got shape {arr.shape}")
    arr = arr.reshape(-1, arr.shape[-1]) if batched else arr[None, :]
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{fn}: ids must hold at least one token, got shape {arr.shape}")
    if arr.shape[1] > cfg.n_positions:
        raise ValueError(f"{fn}: {arr.shape[1]} tokens exceed the model's context of "
                         f"n_positions={cfg.n_positions}")
    return arr, batched


def path_arg(name, value):
    """A path argument as a str that the file system can take: TypeError for a
    value that is no path, ValueError for an empty one, a NUL character or a
    lone surrogate (``name`` leads each message)."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}") from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise ValueError(f"{name} must not be empty")
    if "\0" in path:
        raise ValueError(f"{name} must not contain a NUL character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not a valid file name (a lone surrogate)") from None
    return path

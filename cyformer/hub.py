"""Models by name: a Hugging Face Hub repo id -> a local checkpoint directory.

    cyformer.load("HuggingFaceTB/SmolLM2-135M")

A string that is an existing directory is used as it is.  One that looks
like "owner/name" is resolved through huggingface_hub's snapshot_download
(an optional dependency: ``pip install cyformer[hub]``), restricted to the
files cyformer reads, into the usual Hub cache (HF_HUB_CACHE / HF_HOME), with
its progress bars.  HF_HUB_OFFLINE=1 uses that cache only.
"""

import os
import re

from .errors import ModelLoadError

# Only what the loader reads: never the PyTorch, GGUF or ONNX copies, nor
# Mistral's consolidated.safetensors (the same weights again, in another layout).
FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model*.safetensors",  # model.safetensors, model-00001-of-00004.safetensors, ...
    "model.safetensors.index.json",
]

# huggingface_hub's rule for repo ids: "name" or "owner/name", letters,
# digits, "-", "_", "." (no "--" or ".." and no leading or trailing "-" or ".").
# A bare name is never taken for a repo id here: it is far more often a
# mistyped directory.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def _offline():
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def looks_like_repo_id(name):
    """True for "owner/name" strings that are no path on this machine."""
    return (bool(_REPO_ID.fullmatch(name)) and ".." not in name and "--" not in name
            and not name.endswith((".", "-")) and not os.path.exists(name))


def resolve(path):
    """A local checkpoint directory for ``path``: the path itself when it is a
    directory (or does not look like a repo id; the loader then reports it
    missing), else the Hub snapshot of the repo id ``path``.

    Raises ModelLoadError, in one line, when huggingface_hub is missing, the
    repo is not cached and the Hub cannot be reached (or HF_HUB_OFFLINE=1),
    or the Hub refuses the name.
    """
    if os.path.isdir(path) or not looks_like_repo_id(path):
        return path
    try:
        import huggingface_hub
        from huggingface_hub import constants
    except ImportError:
        raise ModelLoadError(
            f"{path}: no such directory; to load it from the Hugging Face Hub by name, "
            "install the hub extra: pip install 'cyformer[hub]'") from None
    # The environment is read here too, not only at huggingface_hub's import,
    # so that setting HF_HUB_OFFLINE in a running process counts.
    offline = _offline() or bool(getattr(constants, "HF_HUB_OFFLINE", False))
    try:
        return huggingface_hub.snapshot_download(path, allow_patterns=FILES, local_files_only=offline)
    except Exception as e:  # a download is network and disk: anything may fail
        raise ModelLoadError(_explain(path, e, offline)) from None


def _explain(path, error, offline):
    """One line for what snapshot_download raised."""
    from huggingface_hub.utils import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError
    try:  # newer versions only; a subclass of LocalEntryNotFoundError
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:
        IncompleteSnapshotError = ()

    if isinstance(error, IncompleteSnapshotError):
        return (f"{path}: the cached copy is incomplete and the Hub could not be reached to finish it; "
                "run again with network access")
    if isinstance(error, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the Hub could not be reached"
        return (f"{path}: not a directory, and not in the local Hugging Face cache while {why}; "
                "download it once with network access, or pass the path of a checkpoint directory")
    if isinstance(error, GatedRepoError):  # before RepositoryNotFoundError, its base class
        return (f"{path}: a gated repository on the Hugging Face Hub; accept its terms on the "
                "website and log in (hf auth login)")
    if isinstance(error, RepositoryNotFoundError):
        return (f"{path}: not a directory, and no such model on the Hugging Face Hub "
                "(or it is private: log in with hf auth login)")
    if isinstance(error, ValueError):  # HFValidationError: a name the Hub would never accept
        return f"{path}: not a directory, nor a valid Hub repo id ({error})"
    return f"{path}: downloading from the Hugging Face Hub failed ({type(error).__name__}: {error})"

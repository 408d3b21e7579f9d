"""Models by name: a Hub cache built here, never the network."""

import os
import shutil
import subprocess
import sys

import pytest

import cyformer
from cyformer import ModelLoadError, hub
from cyformer.loader import default_model_path

pytest.importorskip("huggingface_hub")

REPO = "someone/pycode-mini"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# A port nothing listens on: connections are refused at once.
DEAD_ENDPOINT = "http://127.0.0.1:9"


def build_cache(root):
    """The layout huggingface_hub writes: models--owner--name/{refs/main, snapshots/<commit>/...}."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(default_model_path(), snapshot)
    os.makedirs(repo / "refs")
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hub cache holding REPO.  huggingface_hub reads its
    environment at import, so its constants are patched as well."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    snapshot = build_cache(cache)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", DEAD_ENDPOINT)  # should anything try
    return cache, snapshot


def test_load_by_name_from_the_cache(hub_cache):
    _, snapshot = hub_cache
    m = cyformer.load(REPO)
    assert os.path.samefile(m.path, snapshot)
    bundled = cyformer.load()
    assert (m.generate("def fib(n):", max_new_tokens=8, seed=2)  # the bundled model samples
            == bundled.generate("def fib(n):", max_new_tokens=8, seed=2))


def test_not_cached_while_offline_is_one_clear_error(hub_cache):
    with pytest.raises(ModelLoadError) as e:
        cyformer.load("someone/not-downloaded")
    msg = str(e.value)
    assert msg.startswith("someone/not-downloaded: not a directory, and not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE=1" in msg and "network access" in msg and "\n" not in msg


def test_a_directory_wins_over_a_repo_id(hub_cache, tmp_path, monkeypatch):
    local = tmp_path / "work" / REPO
    shutil.copytree(default_model_path(), local)
    monkeypatch.chdir(tmp_path / "work")
    # the local directory, not the Hub cache's snapshot (Model.path is made absolute at load)
    assert os.path.realpath(cyformer.load(REPO).path) == os.path.realpath(local)


@pytest.mark.parametrize("name", ["/no/such/dir", "no-such-dir", "a/b/c", "./x/y", "a/../b", "a--b/c"])
def test_names_that_are_no_repo_id_are_missing_directories(hub_cache, name):
    assert not hub.looks_like_repo_id(name)
    with pytest.raises(ModelLoadError, match="not found"):
        cyformer.load(name)


def test_only_the_files_cyformer_reads(hub_cache, monkeypatch, tmp_path):
    import huggingface_hub

    _, snapshot = hub_cache
    seen = {}

    def fake(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert hub.resolve(REPO) == str(snapshot)
    assert seen["repo_id"] == REPO and seen["local_files_only"] is False
    patterns = seen["allow_patterns"]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json"):
        assert f in patterns
    from huggingface_hub.utils import filter_repo_objects

    repo = ["model.safetensors", "model-00001-of-00002.safetensors", "consolidated.safetensors",
            "pytorch_model.bin", "model.gguf", "onnx/model.onnx", "README.md", "tokenizer.model"]
    assert list(filter_repo_objects(repo, allow_patterns=patterns)) == repo[:2]


def test_hub_errors_become_one_line(hub_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.utils import RepositoryNotFoundError

    def missing(repo_id, **kwargs):
        # its constructor wants an HTTP response, which differs between versions
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        error.args = ("404 Client Error.\n\nRepository Not Found for url: ...",)
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(ModelLoadError, match=r"^someone/x: not a directory, and no such model on the "
                                             r"Hugging Face Hub \(or it is private"):
        cyformer.load("someone/x")

    def broken(repo_id, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", broken)
    with pytest.raises(ModelLoadError, match=r"downloading from the Hugging Face Hub failed \(RuntimeError"):
        cyformer.load("someone/x")


def test_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ModelLoadError, match=r"pip install 'cyformer\[hub\]'"):
        cyformer.load("someone/anything")


def run_cli(*args, env):
    exe = os.path.join(os.path.dirname(sys.executable), "cyformer")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "cyformer"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env={**clean, **env})


def test_cli_model_by_name(tmp_path):
    build_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = run_cli("generate", "def fib(n):", "--model", REPO, "-n", "5", "--seed", "1", env=env)
    want = cyformer.load().generate("def fib(n):", max_new_tokens=5, seed=1)  # the model samples
    assert r.returncode == 0, r.stderr
    assert r.stdout == "def fib(n):" + want + "\n"
    r = run_cli("info", "--model", REPO, "--json", env=env)
    assert r.returncode == 0 and COMMIT in r.stdout


def test_cli_not_cached_offline(tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    r = run_cli("generate", "x", "--model", "someone/missing", env=env)
    assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "cyformer: error: someone/missing: not a directory, and not in the local Hugging Face cache while "
        "HF_HUB_OFFLINE=1 is set; download it once with network access, or pass the path of a checkpoint "
        "directory"]


def test_cli_not_cached_and_the_hub_unreachable(tmp_path):
    """Online mode with a Hub that refuses connections (a local dead port, so
    that the test never leaves the machine): the same one-line error;
    and a cached model still loads."""
    build_cache(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": DEAD_ENDPOINT}
    r = run_cli("generate", "x", "--model", "someone/missing", env=env)  # run_cli's timeout catches a hang
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not in the local Hugging Face cache while the Hub could not be reached" in r.stderr
    r = run_cli("generate", "def", "--model", REPO, "-n", "3", env=env)
    assert r.returncode == 0, r.stderr

"""Loading: config parsing, name mapping and the errors for broken checkpoints."""

import json
import os
import shutil

import numpy as np
import pytest

import cyformer
from cyformer import Config, CyformerError, ModelLoadError
from helpers import edit_config


def copy_ckpt(checkpoint, tmp_path, name="odd"):
    src, _ = checkpoint(name)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_error_hierarchy():
    assert issubclass(ModelLoadError, CyformerError)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        cyformer.load(tmp_path / "nope")


def test_missing_files(checkpoint, tmp_path):
    d = copy_ckpt(checkpoint, tmp_path)
    os.remove(d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        cyformer.load(d)
    os.remove(d / "config.json")
    with pytest.raises(ModelLoadError, match="config.json"):
        cyformer.load(d)


def test_config_defaults_are_hf_defaults():
    from transformers import GPT2Config

    hf = GPT2Config()
    ours = Config.from_dict({})
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                "activation_function", "layer_norm_epsilon", "bos_token_id", "eos_token_id"):
        assert getattr(ours, key) == getattr(hf, key), key


@pytest.mark.parametrize("change,match", [
    ({"n_head": 0}, "n_head"),
    ({"n_head": 5}, "divisible"),
    ({"n_embd": -48}, "n_embd"),
    ({"n_layer": "2"}, "n_layer"),
    ({"activation_function": "relu"}, "activation_function"),
    ({"layer_norm_epsilon": -1}, "layer_norm_epsilon"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_bad_config_values(checkpoint, tmp_path, change, match):
    d = copy_ckpt(checkpoint, tmp_path)
    edit_config(d, **change)
    with pytest.raises(ModelLoadError, match=match):
        cyformer.load(d)


def test_config_not_json(checkpoint, tmp_path):
    d = copy_ckpt(checkpoint, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        cyformer.load(d)


def test_config_disagrees_with_tensors(checkpoint, tmp_path):
    d = copy_ckpt(checkpoint, tmp_path)
    edit_config(d, n_inner=78)
    with pytest.raises(ModelLoadError, match=r"h\.0\.mlp\.c_fc\.weight.*shape"):
        cyformer.load(d)


def test_missing_tensor(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_ckpt(checkpoint, tmp_path)
    tensors = load_file(d / "model.safetensors")
    key = next(k for k in tensors if k.endswith("h.1.ln_2.bias"))
    del tensors[key]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor .*h\.1\.ln_2\.bias"):
        cyformer.load(d)


def test_integer_tensor_rejected(checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = copy_ckpt(checkpoint, tmp_path)
    tensors = load_file(d / "model.safetensors")
    key = next(k for k in tensors if k.endswith("ln_f.bias"))
    tensors[key] = tensors[key].astype(np.int32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="ln_f.bias.*dtype"):
        cyformer.load(d)


def test_truncated_file(checkpoint, tmp_path):
    d = copy_ckpt(checkpoint, tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        cyformer.load(d)


def test_weights_are_read_only(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    with pytest.raises(ValueError):
        m.weights.wte[0, 0] = 1.0


def test_weights_fill_one_aligned_arena_exactly_as_stored(checkpoint):
    """Every tensor equals what the safetensors package reads, sits on a
    64-byte boundary inside one 2 MB-aligned arena (so the OS can back it with
    huge pages), and the arena holds nothing else."""
    from safetensors.numpy import load_file

    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    stored = load_file(os.path.join(path, "model.safetensors"))
    w = m.weights
    arrays = {"wte.weight": w.wte, "wpe.weight": w.wpe, "ln_f.weight": w.ln_f.weight, "ln_f.bias": w.ln_f.bias}
    for i, b in enumerate(w.blocks):
        for name, arr in (("ln_1.weight", b.ln_1.weight), ("ln_1.bias", b.ln_1.bias),
                          ("attn.c_attn.weight", b.c_attn.weight), ("attn.c_attn.bias", b.c_attn.bias),
                          ("attn.c_proj.weight", b.attn_c_proj.weight), ("attn.c_proj.bias", b.attn_c_proj.bias),
                          ("ln_2.weight", b.ln_2.weight), ("ln_2.bias", b.ln_2.bias),
                          ("mlp.c_fc.weight", b.c_fc.weight), ("mlp.c_fc.bias", b.c_fc.bias),
                          ("mlp.c_proj.weight", b.mlp_c_proj.weight), ("mlp.c_proj.bias", b.mlp_c_proj.bias)):
            arrays[f"h.{i}.{name}"] = arr
    prefix = "transformer." if any(k.startswith("transformer.") for k in stored) else ""
    starts = []
    for name, arr in arrays.items():
        np.testing.assert_array_equal(arr, stored[prefix + name], err_msg=name)
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and not arr.flags.writeable
        assert arr.ctypes.data % 64 == 0, name
        starts.append((arr.ctypes.data, arr.nbytes))
    starts.sort()
    base = starts[0][0]
    assert base % (2 << 20) == 0
    end = starts[-1][0] + starts[-1][1]
    assert end - base < sum(n for _, n in starts) + 64 * len(starts)  # packed, no stray copies


def test_bad_ids(checkpoint):
    path, _ = checkpoint("odd")
    m = cyformer.load(path)
    for bad, match in [([101], "101"), ([-1], "-1"), ([], "at least one"), (np.zeros((1, 1, 2), int), "1-D"),
                       (np.array([1.0, 2.0]), "integer"), (np.array([True]), "integer"),
                       (np.zeros(41, int), "n_positions")]:
        with pytest.raises(ValueError, match=match):
            m.forward(bad)


def test_threads_argument(checkpoint, monkeypatch):
    path, _ = checkpoint("odd")
    assert cyformer.load(path, threads=3).threads == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cyformer.load(path).threads == 1
    with pytest.raises(ValueError, match="threads"):
        cyformer.load(path, threads=0)


def test_build_info():
    info = cyformer.build_info()
    for key in ("openmp", "compile_flags", "cython", "threads", "isa"):
        assert key in info
    assert info["openmp"] is True  # the wheel under test is built with OpenMP
    assert "-ffast-math" not in info["compile_flags"] and "-Ofast" not in info["compile_flags"]
    assert info["threads"] >= 1


def test_installed_package_is_under_test():
    """The suite runs against the installed wheel, not the source tree."""
    assert "site-packages" in cyformer.__file__ or os.environ.get("CYFORMER_TEST_SOURCE")

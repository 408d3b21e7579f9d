"""The whole model against Hugging Face GPT2LMHeadModel on PyTorch CPU.

Tolerance: max |logit difference| <= 1e-4 (float32 arithmetic lands near
1e-5), and the same argmax at every position.
"""

import numpy as np
import pytest

import cyformer
from helpers import compare_logits

TOL = 1e-4


def compare(model, hf, ids):
    return compare_logits(model, hf, ids, TOL)


@pytest.mark.parametrize("name", ["odd", "erf"])
@pytest.mark.parametrize("threads", [1, 2])
def test_small_geometries(checkpoint, name, threads, rng):
    path, hf = checkpoint(name)
    model = cyformer.load(path, threads=threads)
    cfg = model.config
    for T in (1, 2, 13, 31, cfg.n_positions):  # 13 and 31 are prime
        compare(model, hf, rng.integers(0, cfg.vocab_size, size=T))
    compare(model, hf, rng.integers(0, cfg.vocab_size, size=(2, 17)))


@pytest.mark.slow
def test_gpt2_small(checkpoint, rng):
    """GPT-2 small geometry: 1 and 2 threads both match HF and each other bitwise."""
    path, hf = checkpoint("gpt2-small")
    m1 = cyformer.load(path, threads=1)
    m2 = cyformer.load(path, threads=2)
    assert m1.weights.tied  # HF saves no lm_head when tied
    for ids in (rng.integers(0, 50257, size=1), rng.integers(0, 50257, size=61),
                rng.integers(0, 50257, size=(2, 7))):
        a = compare(m1, hf, ids)
        b = compare(m2, hf, ids)
        assert np.array_equal(a, b), "logits differ between 1 and 2 threads"
    ids = rng.integers(0, 50257, size=1024)  # T = n_positions
    a = compare(m2, hf, ids)
    assert np.array_equal(a, m1.forward(ids))


def test_bitwise_identical_across_thread_counts(checkpoint, rng):
    path, _ = checkpoint("erf")
    ids = rng.integers(0, 257, size=(2, 67))
    ref = cyformer.load(path, threads=1).forward(ids)
    for n in (2, 3, 4):
        assert np.array_equal(ref, cyformer.load(path, threads=n).forward(ids))


def test_forward_shapes_and_config(checkpoint):
    path, hf = checkpoint("odd")
    model = cyformer.load(path)
    assert model.config.n_head == 3 and model.config.d_mlp == 77 and model.config.d_head == 16
    assert model.forward([1, 2, 3]).shape == (3, 101)
    assert model.forward(np.array([[1, 2, 3]], dtype=np.int32)).shape == (1, 3, 101)


def test_transformer_prefix_and_untied_lm_head(checkpoint, tmp_path, rng):
    """Checkpoints saved with a 'transformer.' prefix, an explicit lm_head and
    the old attn.bias mask buffers load too; an untied lm_head is used as is."""
    from safetensors.numpy import load_file, save_file

    path, hf = checkpoint("odd")
    import glob
    tensors = load_file(glob.glob(f"{path}/*.safetensors")[0])
    wte = next(v for k, v in tensors.items() if k.endswith("wte.weight"))
    lm_head = (wte + 0.01 * rng.standard_normal(wte.shape)).astype(np.float32)
    renamed = {("transformer." + k if not k.startswith("transformer.") else k): v for k, v in tensors.items()}
    renamed["lm_head.weight"] = lm_head
    renamed["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 40, 40), np.float32))
    save_file(renamed, str(tmp_path / "model.safetensors"))
    import shutil
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    model = cyformer.load(tmp_path)
    assert not model.weights.tied
    ids = rng.integers(0, 101, size=9)
    ref = cyformer.load(path).forward(ids)
    got = model.forward(ids)
    # the final layer norm output is unchanged, so logits move by x @ (lm_head - wte).T
    import torch
    with torch.no_grad():
        hidden = hf.transformer(torch.as_tensor(ids[None])).last_hidden_state[0].numpy()
    np.testing.assert_allclose(got - ref, hidden @ (lm_head - wte).T, atol=1e-4)

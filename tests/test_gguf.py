"""GGUF files (cyformer.gguf): read, write, fidelity, bad files.

Every file is made here from a random-weight checkpoint (GPT-2 and Llama
geometries, the bundled model's tokenizer) with cyformer's writer or the
``gguf`` package's writer and quantizers; nothing is downloaded.  Bounds:

- F32: the safetensors model's logits, <= 1e-4 (they are computed from the
  same float32 weights, so in practice equal).
- F16, BF16, Q4_0, Q8_0: run without loss of the file's values (F16 widened
  to float32, BF16 as bfloat16, Q8_0 and Q4_0 natively as q8_0 and q4_0,
  their records memory-mapped from the file),
  so against a float32 model of the file's dequantized weights
  (``load(path, dtype="float32")``) the forward pass differs only by float32
  summation order: <= 1e-4 relative to the largest logit.
- Q4_K, Q5_K, Q6_K are converted at load (cyformer.gguf.RUNS): the
  logits match the float reference within the error of that conversion,
  which is bounded by converting the reference's own float weights the same
  way (``load(path, dtype=fmt)`` gives identical logits: the same weights).
"""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import cyformer
from cyformer.errors import ModelLoadError

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'cyformer[gguf]') reads and writes GGUF")

from gguf_files import TOKENIZER_TEXTS, float_tensor, q4_k_blocks, random_blocks, rewrite  # noqa: E402
from helpers import make_hf_checkpoint, make_hf_llama  # noqa: E402

Q = gguf.GGMLQuantizationType
PYCODE = os.path.join(os.path.dirname(cyformer.__file__), "data", "pycode")
TEXT = "def fib(n):\n    if n < 2:\n        return n  # 1234 ünïcode\n    return fib(n - 1) + fib(n - 2)\n"


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt2")
    hf = make_hf_checkpoint(str(d), seed=3, tokenizer_dir=PYCODE, vocab_size=4096, n_positions=128,
                            n_embd=64, n_layer=2, n_head=4)
    return str(d), hf


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    # inputs of 256 (k-quant super-blocks), 4 query heads of 64 sharing 2 key/value heads
    hf = make_hf_llama(str(d), seed=4, vocab_size=4096, hidden_size=256, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=128, rope_theta=5000.0, tie_word_embeddings=False)
    shutil.copy(os.path.join(PYCODE, "tokenizer.json"), str(d))
    return str(d), hf


def _ids(model):
    return model.encode(TEXT)


# -- F32 / F16: the safetensors model's logits -----------------------------------

@pytest.mark.parametrize("which", ["gpt2", "llama", "qwen2"])
def test_f32_file_gives_the_safetensors_logits(tmp_path, gpt2_dir, llama_dir, which):
    if which == "qwen2":
        d = str(tmp_path / "qwen2")
        make_hf_llama(d, "qwen2", seed=5, vocab_size=4096, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)
        shutil.copy(os.path.join(PYCODE, "tokenizer.json"), d)
    else:
        d = gpt2_dir[0] if which == "gpt2" else llama_dir[0]
    st = cyformer.load(d, threads=2)
    path = st.save(str(tmp_path / "m.gguf"), format="gguf", dtype="f32")
    g = cyformer.load(path, threads=2)
    same = ("n_inner", "head_dim")  # None: the default (4 C, C / H), which the file spells out
    assert ({k: v for k, v in g.config.to_dict().items() if k not in same}
            == {k: v for k, v in st.config.to_dict().items() if k not in same})
    assert (g.config.d_mlp, g.config.d_head) == (st.config.d_mlp, st.config.d_head)
    ids = _ids(st)
    assert g.encode(TEXT) == ids
    diff = np.abs(g.forward(ids) - st.forward(ids)).max()
    assert diff <= 1e-4, diff
    assert g.generate(ids, max_new_tokens=8) == st.generate(ids, max_new_tokens=8)


def test_llama_rows_are_in_llama_cpp_order(tmp_path, llama_dir):
    """transformers reads the file independently (its GGUF loader undoes
    llama.cpp's q/k permutation itself): the logits equal the original
    model's, so the file holds llama.cpp's row order, not ours."""
    import torch
    from transformers import AutoModelForCausalLM

    d, hf = llama_dir
    path = cyformer.load(d).save(str(tmp_path / "l.gguf"), format="gguf", dtype="f32")
    other = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="l.gguf").eval()
    ids = torch.tensor([[5, 17, 300, 2, 4000, 9, 9, 81]])
    with torch.no_grad():
        diff = (other(ids).logits - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    q = float_tensor(path, "blk.0.attn_q.weight")
    assert not np.allclose(q, hf.model.layers[0].self_attn.q_proj.weight.detach().numpy())


def test_f16_file_is_its_weights_widened(tmp_path, gpt2_dir):
    st = cyformer.load(gpt2_dir[0], threads=2)
    path = st.save(str(tmp_path / "h.gguf"), format="gguf", dtype="f16")
    g = cyformer.load(path, threads=2)
    assert g.dtype == "float32"
    ids = _ids(st)
    w = float_tensor(path, "blk.0.attn_qkv.weight")   # [out, in]
    np.testing.assert_array_equal(g.weights.blocks[0].c_attn.weight, w.T)
    ref = st.forward(ids)
    # the only change is each weight rounded to fp16 (relative 2^-11)
    assert np.abs(g.forward(ids) - ref).max() <= 0.02 * np.abs(ref).max()


# -- quantized types against the file's dequantized weights --------------------------

def _with_types(src, dst, qtype, rng, names=None):
    """src with every 2-d block matrix (or those in names) replaced by qtype blocks."""
    r = gguf.GGUFReader(src)
    out = {}
    for t in r.tensors:
        if len(t.shape) != 2 or t.name == "position_embd.weight" or (names and t.name not in names):
            continue
        w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if qtype == Q.Q4_K and w.shape[1] % 256 == 0:
            out[t.name] = (q4_k_blocks(w), qtype)
        elif qtype in (Q.Q5_K, Q.Q6_K) or (qtype == Q.Q4_K and w.shape[1] % 256 == 0):
            out[t.name] = (random_blocks(rng, qtype, *w.shape, rms=float(np.sqrt(np.mean(w * w)))), qtype)
        elif qtype == Q.BF16:
            out[t.name] = (gguf.quants.quantize(w, qtype), qtype)
    return rewrite(src, dst, tensors=out)


@pytest.mark.parametrize("qtype, runs, how", [("q8_0", "q8_0", "mapped"), ("q4_0", "q4_0", "mapped")])
def test_written_quantized_types(tmp_path, gpt2_dir, qtype, runs, how):
    st = cyformer.load(gpt2_dir[0], threads=2)
    path = st.save(str(tmp_path / f"{qtype}.gguf"), format="gguf", dtype=qtype)
    g = cyformer.load(path, threads=2)
    ref = cyformer.load(path, threads=2, dtype="float32")  # the file's dequantized weights
    assert g.dtype == runs and g.gguf_tensors["attn_qkv"] == {"file": qtype.upper(), "runs": runs, "how": how}
    ids = _ids(st)
    got, want = g.forward(ids), ref.forward(ids)
    # prefill multiplies the records by int8 activations where the CPU has
    # the integer GEMM (VNNI), as decode does: within 4 % of the largest logit
    # of the float weights (measured 1.5 % Q8_0, 1.9 % Q4_0), and the terms of decode's
    # one-token steps in another order (<= 1e-4); elsewhere it widens them to
    # float32, and only summation order differs from the float weights
    from cyformer.kernels import linalg
    if linalg.integer_gemm(qtype):
        be = g.backend
        kv = be.new_cache(len(ids))
        steps = np.stack([np.asarray(be.run(ids[t:t + 1], kv, True))[-1] for t in range(len(ids))])
        assert np.abs(got - steps).max() <= 1e-4 * np.abs(steps).max()
        assert np.abs(got - want).max() <= 0.04 * np.abs(want).max()
    else:
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # the same codes and scales
    w = ref.weights.blocks[1].mlp_c_proj.weight
    np.testing.assert_array_equal(g.weights.blocks[1].mlp_c_proj.weight.dequantize(), w)


def _mapped_from(arr, path):
    """True when arr's memory lies in a mapping of the file at path (Linux's /proc/self/maps)."""
    start = arr.__array_interface__["data"][0]
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            if lo <= start < hi:
                return len(parts) == 6 and parts[5].strip() == real
    return False


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings from /proc")
@pytest.mark.parametrize("which", ["gpt2", "llama"])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_block_types_run_from_the_file_s_own_bytes(tmp_path, gpt2_dir, llama_dir, which, qtype):
    """Q8_0 runs as q8_0, Q4_0 as q4_0: a matrix that is one tensor of the
    file (GPT-2's every matrix, Llama's attn_output, ffn_down and the
    embeddings) is the file's records in place, memory-mapped and read-only,
    not a copy; Llama's q | k | v and gate | up (several tensors, q and k
    rows permuted) hold the same records, copied.  Decode is the numpy
    reference's product on those records, and writing the model again gives
    the same bytes."""
    from cyformer.backends import numpy_ref
    from cyformer.gguf import _unpermute
    from cyformer.kernels import linalg

    matvec = getattr(numpy_ref, f"{qtype}_matvec")
    d = gpt2_dir[0] if which == "gpt2" else llama_dir[0]
    path = cyformer.load(d).save(str(tmp_path / "q.gguf"), format="gguf", dtype=qtype)
    g = cyformer.load(path, threads=2)
    w, r = g.weights, gguf.GGUFReader(path)
    file = {t.name: np.asarray(t.data) for t in r.tensors}
    one = {"wte": "token_embd.weight", "attn": "blk.1.attn_output.weight", "down": "blk.0.ffn_down.weight"}
    arrays = {"wte": w.wte, "attn": w.blocks[1].attn_c_proj.weight, "down": w.blocks[0].mlp_c_proj.weight}
    if which == "gpt2":
        one["qkv"], arrays["qkv"] = "blk.0.attn_qkv.weight", w.blocks[0].c_attn.weight
    else:
        one["lm_head"], arrays["lm_head"] = "output.weight", w.lm_head
    for k, name in one.items():
        a = arrays[k]
        assert a.fmt == qtype and a.scale is None
        assert not a.data.flags.owndata and not a.data.flags.writeable
        assert _mapped_from(a.data, path), f"{k} is not a view of the file's mapping"
        np.testing.assert_array_equal(a.data, file[name])
    qkv = w.blocks[0].c_attn.weight
    if which == "llama":  # copied: its parts' records, q and k rows back in Hugging Face's order
        assert not _mapped_from(qkv.data, path)
        want = np.concatenate([_unpermute(file["blk.0.attn_q.weight"], 4), _unpermute(file["blk.0.attn_k.weight"], 2),
                               file["blk.0.attn_v.weight"]])
        np.testing.assert_array_equal(qkv.data, want)
    x = np.random.default_rng(0).standard_normal((1, g.config.n_embd)).astype(np.float32)
    got = linalg.linear_forward(x, qkv, threads=2)
    np.testing.assert_array_equal(got[0], matvec(x[0], qkv.data))
    again = g.save(str(tmp_path / "again.gguf"), format="gguf", dtype=qtype)
    for x1, y1 in zip(r.tensors, gguf.GGUFReader(again).tensors):
        assert x1.name == y1.name and x1.tensor_type == y1.tensor_type
        np.testing.assert_array_equal(np.asarray(x1.data), np.asarray(y1.data), err_msg=x1.name)


# qtype -> (the old path's format, the bound on each step's largest error
# relative to the largest logit)
DECODE_VS_FLOAT = {"q8_0": ("int8", 0.03), "q4_0": ("int4", 0.03)}


@pytest.mark.parametrize("qtype", list(DECODE_VS_FLOAT))
def test_block_decode_against_the_file_s_float_weights(tmp_path, llama_dir, qtype):
    """Decode multiplies int8 activation blocks by the records.  Against a
    float32 model of the file's dequantized weights (gguf.quants.dequantize),
    over 24 steps of this random-weight model: every step within 3 % of the
    largest logit.  Q8_0 measured <= 2.04 %, mean 1.5 %, on average closer
    than the old path, Q8_0 converted to int8 per output (mean 2.4 %, max
    3.1 %): the same activation rule, finer weight scales.  Q4_0 measured
    <= 2.08 %, mean 1.54 %; the old path, Q4_0 repacked into int4, holds the
    same weights and rounds activations by the same rule (2.02 %, 1.44 %:
    only the order of the sums differs), so it is no yardstick there."""
    path = cyformer.load(llama_dir[0]).save(str(tmp_path / "q.gguf"), format="gguf", dtype=qtype)
    ref = cyformer.load(path, threads=2, dtype="float32")
    w = float_tensor(path, "blk.1.ffn_down.weight")  # gguf.quants.dequantize of the records
    np.testing.assert_array_equal(ref.weights.blocks[1].mlp_c_proj.weight, w.T)
    ids = _ids(ref)[:24]
    errs = {}
    old, bound = DECODE_VS_FLOAT[qtype]
    for dtype in (qtype, old):
        be, rb = cyformer.load(path, threads=2, dtype=dtype).backend, ref.backend
        kv, kr = be.new_cache(32), rb.new_cache(32)
        errs[dtype] = []
        for t in ids:
            got = np.asarray(be.run(np.array([t]), kv, True))[-1]
            want = np.asarray(rb.run(np.array([t]), kr, True))[-1]
            errs[dtype].append(np.abs(got - want).max() / np.abs(want).max())
    assert max(errs[qtype]) <= bound, errs[qtype]
    if qtype == "q8_0":
        assert np.mean(errs[qtype]) < np.mean(errs[old])


# Held-out perplexity of the bundled model from GGUF files against its float32
# (tests/test_formats.py's measure): the issue's bounds, Q8_0 within 1 %,
# Q4_0 and Q4_K within 6 %.  Q4_K here is the plain quantizer of gguf_files
# on every matrix (no Q6_K mix, no llama.cpp search): a harder case than a
# real Q4_K_M file.  Measured (prefill on the integer GEMM, int8 activations,
# where the CPU has VNNI): Q8_0 +0.21 % (records widened to float32: +0.04 %;
# converted to int8 with float activations: +0.07 %), Q4_0 +3.66 % (its
# embedding in Q4_0 as the file holds it; widened: +3.67 %), Q4_K +5.15 %
# (converted to int8; its weights in float32: +4.8 %).
GGUF_BOUNDS = {"q8_0": 0.01, "q4_0": 0.06, "q4_k": 0.06}


@pytest.mark.parametrize("qtype", list(GGUF_BOUNDS))
def test_accuracy_on_held_out_code(tmp_path, qtype):
    from test_formats import held_out_ids, perplexity_and_top1

    m = cyformer.load(threads=2)
    ids = held_out_ids(m)
    ppl32, _ = perplexity_and_top1(m, ids)
    path = m.save(str(tmp_path / "m.gguf"), format="gguf", dtype="f32" if qtype == "q4_k" else qtype)
    if qtype == "q4_k":
        path = _with_types(path, tmp_path / "k.gguf", Q.Q4_K, None)
    g = cyformer.load(path, threads=2)
    ppl, _ = perplexity_and_top1(g, ids)
    assert abs(ppl / ppl32 - 1) <= GGUF_BOUNDS[qtype], f"{qtype}: perplexity {ppl:.4f} vs float32 {ppl32:.4f}"
    print(f"{qtype}: perplexity {ppl:.4f} vs float32 {ppl32:.4f} ({ppl / ppl32 - 1:+.2%})")


def test_accuracy_of_llama_cpp_q4_k_m(tmp_path):
    """A real Q4_K_M file, made by llama.cpp's own quantizer from cyformer's
    F32 file (Q4_K, with Q6_K for the embedding and some attn_v/ffn_down):
    within 6 % of float32's held-out perplexity (measured +1.09 %)."""
    import ctypes

    from test_formats import held_out_ids, perplexity_and_top1

    llama_cpp = _llama_cpp()
    m = cyformer.load(threads=2)
    ids = held_out_ids(m)
    ppl32, _ = perplexity_and_top1(m, ids)
    src = m.save(str(tmp_path / "f32.gguf"), format="gguf", dtype="f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    dst = str(tmp_path / "q4_k_m.gguf")
    assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)) == 0
    g = cyformer.load(dst, threads=2)
    assert g.gguf_tensors["token_embd"]["file"] == "Q6_K" and "Q4_K" in g.gguf_tensors["ffn_up"]["file"]
    ppl, _ = perplexity_and_top1(g, ids)
    assert abs(ppl / ppl32 - 1) <= 0.06, f"Q4_K_M: perplexity {ppl:.4f} vs float32 {ppl32:.4f}"


def test_mixed_types_run_in_the_most_precise(tmp_path, llama_dir):
    """q/k in Q4_0 (q4_0), v in Q8_0 (q8_0): the fused q|k|v runs as q8_0,
    every part converted from its dequantized weights."""
    q4 = cyformer.load(llama_dir[0]).save(str(tmp_path / "q4.gguf"), format="gguf", dtype="q4_0")
    v = {}
    for i in range(2):
        n = f"blk.{i}.attn_v.weight"
        v[n] = (gguf.quants.quantize(float_tensor(q4, n), Q.Q8_0), Q.Q8_0)
    g = cyformer.load(rewrite(q4, tmp_path / "mixed.gguf", tensors=v))
    assert g.weights.blocks[0].c_attn.weight.fmt == "q8_0"
    assert g.weights.blocks[0].mlp_c_proj.weight.fmt == "q4_0"
    assert g.gguf_tensors["attn_v"] == {"file": "Q8_0", "runs": "q8_0", "how": "converted"}
    assert g.gguf_tensors["attn_q"] == {"file": "Q4_0", "runs": "q8_0", "how": "converted"}


# -- writing: cyformer reloads bitwise; the CLI ------------------------------------

@pytest.mark.parametrize("qtype", ["f32", "q4_0"])
def test_read_and_written_again_is_the_same_file(tmp_path, llama_dir, qtype):
    m = cyformer.load(llama_dir[0])
    a = m.save(str(tmp_path / "a.gguf"), format="gguf", dtype=qtype)
    b = cyformer.load(a).save(str(tmp_path / "b.gguf"), format="gguf", dtype=qtype)
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    for x, y in zip(ra.tensors, rb.tensors):
        assert x.tensor_type == y.tensor_type
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=x.name)


def test_cli_quantize_and_info(tmp_path, gpt2_dir):
    out = str(tmp_path / "q.gguf")
    run = [sys.executable, "-m", "cyformer"]
    p = subprocess.run(run + ["quantize", gpt2_dir[0], out, "--dtype", "q8_0"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "Q8_0" in p.stdout or "q8_0" in p.stdout
    p = subprocess.run(run + ["info", "--model", out], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "attn_qkv" in p.stdout and "Q8_0 -> q8_0 (mapped)" in p.stdout
    p = subprocess.run(run + ["generate", "def f(", "--model", out, "-n", "4"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out4 = str(tmp_path / "q4.gguf")
    p = subprocess.run(run + ["quantize", gpt2_dir[0], out4, "--dtype", "q4_0"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(run + ["info", "--model", out4], capture_output=True, text=True)
    assert p.returncode == 0 and "Q4_0 -> q4_0 (mapped)" in p.stdout, p.stdout + p.stderr
    p = subprocess.run(run + ["quantize", gpt2_dir[0], out, "--dtype", "q5_1"], capture_output=True, text=True)
    assert p.returncode != 0 and "Traceback" not in p.stderr


def test_pickling_loads_the_file_again(tmp_path, gpt2_dir):
    import pickle

    path = cyformer.load(gpt2_dir[0]).save(str(tmp_path / "p.gguf"), format="gguf", dtype="q4_0")
    m = cyformer.load(path)
    again = pickle.loads(pickle.dumps(m))
    ids = _ids(m)
    np.testing.assert_array_equal(again.forward(ids), m.forward(ids))


# -- the tokenizer --------------------------------------------------------------

def _variant(src, dst, pre_tokenizer, normalizer=None, ignore_merges=False):
    import json

    with open(os.path.join(src, "tokenizer.json")) as f:
        tj = json.load(f)
    tj["pre_tokenizer"], tj["normalizer"] = pre_tokenizer, normalizer
    tj["model"]["ignore_merges"] = ignore_merges
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tj, f)


def _split(pattern):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_encodes_as_tokenizer_json(tmp_path, pre):
    from cyformer.gguf import LLAMA3_SPLIT, QWEN2_SPLIT

    d = str(tmp_path / "m")
    make_hf_checkpoint(d, seed=1, vocab_size=4096, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    variants = {
        "gpt-2": (byte_level, None, False),
        "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                          byte_level]}, None, False),
        "llama-bpe": (_split(LLAMA3_SPLIT), None, True),
        "qwen2": (_split(QWEN2_SPLIT), {"type": "NFC"}, False),
    }
    _variant(PYCODE, d, *variants[pre])
    st = cyformer.load(d)
    path = st.save(str(tmp_path / "t.gguf"), format="gguf")
    assert gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == pre
    g = cyformer.load(path)
    for text in TOKENIZER_TEXTS:
        assert g.encode(text) == st.encode(text), text
        ids = st.encode(text)
        assert g.decode(ids) == st.decode(ids)
    assert g.tokenizer.special_tokens() == st.tokenizer.special_tokens()
    for i in (0, 1, 250, 300, 4095):
        assert g.tokenizer.token_bytes(i) == st.tokenizer.token_bytes(i)


def test_chat_template_and_special_tokens_travel(tmp_path, llama_dir):
    import json

    d = str(tmp_path / "chat")
    shutil.copytree(llama_dir[0], d)
    template = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                   "add_bos_token": True}, f)
    st = cyformer.load(d)
    g = cyformer.load(st.save(str(tmp_path / "c.gguf"), format="gguf"))
    assert g.tokenizer.config.chat_template == template
    enc = g.tokenizer.encode("x = 1", add_special_tokens=True)
    assert enc == st.tokenizer.encode("x = 1", add_special_tokens=True) and enc[0] == 0


# -- bad files: a clear ModelLoadError each --------------------------------------------

def _tensor_info_at(path, name):
    """Byte offset just after a tensor's name in the header (n_dims follows)."""
    data = open(path, "rb").read()
    key = len(name).to_bytes(8, "little") + name.encode()
    return data.index(key) + len(key)


def _patch(path, dst, offset, raw):
    data = bytearray(open(path, "rb").read())
    data[offset:offset + len(raw)] = raw
    open(dst, "wb").write(bytes(data))
    return str(dst)


@pytest.fixture(scope="module")
def good(tmp_path_factory, gpt2_dir):
    d = tmp_path_factory.mktemp("good")
    return cyformer.load(gpt2_dir[0]).save(str(d / "good.gguf"), format="gguf", dtype="q8_0")


def test_truncated_file(tmp_path, good):
    data = open(good, "rb").read()
    for n in (0, 3, 20, 2000, len(data) - 100):
        p = tmp_path / f"t{n}.gguf"
        p.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match="truncated|past the end|not a GGUF|empty"):
            cyformer.load(str(p))


def test_lying_offset_shape_and_type(tmp_path, good):
    at = _tensor_info_at(good, "blk.1.ffn_down.weight")          # n_dims u32, dims 2 x u64, type, offset
    bad = _patch(good, tmp_path / "off.gguf", at + 4 + 16 + 4, (2**40).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match="blk.1.ffn_down.weight.*past the end|alignment"):
        cyformer.load(bad)
    bad = _patch(good, tmp_path / "ty.gguf", at + 4 + 16, (99).to_bytes(4, "little"))
    with pytest.raises(ModelLoadError, match="blk.1.ffn_down.weight.*unknown tensor type 99"):
        cyformer.load(bad)
    # a shape the metadata does not give: rows 64 -> 32 (its bytes then end early: no overlap)
    bad = _patch(good, tmp_path / "sh.gguf", at + 4 + 8, (32).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match=r"blk.1.ffn_down.weight.*shape \[32, 256\], expected \[64, 256\]"):
        cyformer.load(bad)
    bad = _patch(good, tmp_path / "magic.gguf", 0, b"GGUX")
    with pytest.raises(ModelLoadError):
        cyformer.load(bad)


def test_unsupported_tensor_type(tmp_path, good):
    r = gguf.GGUFReader(good)
    t = next(t for t in r.tensors if t.name == "blk.0.ffn_up.weight")
    w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
    bad = rewrite(good, tmp_path / "q5.gguf", tensors={t.name: (gguf.quants.quantize(w, Q.Q5_0), Q.Q5_0)})
    with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight.*type Q5_0.*does not read"):
        cyformer.load(bad)


@pytest.mark.parametrize("key", ["gpt2.block_count", "gpt2.embedding_length", "tokenizer.ggml.tokens",
                                 "general.architecture"])
def test_missing_metadata_key(tmp_path, good, key):
    if key == "general.architecture":  # the writer always writes it: blank its value instead
        bad = rewrite(good, tmp_path / "m.gguf", set_keys={key: ("", gguf.GGUFValueType.STRING)})
        match = "architecture '' is not supported"
    else:
        bad = rewrite(good, tmp_path / "m.gguf", drop_keys=(key,))
        match = f"missing metadata key '{key}'"
    with pytest.raises(ModelLoadError, match=match):
        cyformer.load(bad)


@pytest.mark.parametrize("key, value, match", [
    ("tokenizer.ggml.model", "llama", "tokenizer kind 'llama'.*not supported"),
    ("tokenizer.ggml.pre", "deepseek-coder", "pre-tokenizer 'deepseek-coder'.*not supported"),
    ("general.architecture", "falcon", "architecture 'falcon' is not supported"),
])
def test_unsupported_kinds(tmp_path, good, key, value, match):
    bad = rewrite(good, tmp_path / "k.gguf", set_keys={key: (value, gguf.GGUFValueType.STRING)})
    with pytest.raises(ModelLoadError, match=match):
        cyformer.load(bad)


def test_wrongly_typed_metadata(tmp_path, good):
    bad = rewrite(good, tmp_path / "w.gguf", set_keys={"gpt2.block_count": ("two", gguf.GGUFValueType.STRING)})
    with pytest.raises(ModelLoadError, match="gpt2.block_count.*must be int"):
        cyformer.load(bad)


def test_cli_error_has_no_traceback(tmp_path, good):
    p = tmp_path / "t.gguf"
    p.write_bytes(open(good, "rb").read()[:5000])
    r = subprocess.run([sys.executable, "-m", "cyformer", "info", "--model", str(p)], capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "truncated" in r.stderr


# -- llama.cpp on the same file ------------------------------------------------------

def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python): "
                    "the cross-check with llama.cpp needs it")
    return llama_cpp


@pytest.mark.parametrize("which", ["gpt2", "llama"])
@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_0"])
def test_llama_cpp_runs_our_file_like_cyformer(tmp_path, gpt2_dir, llama_dir, which, qtype):
    """llama.cpp loads what cyformer writes.  F32: its logits are the file's
    within 1e-3 of the largest (it keeps the KV cache in F16) and greedy
    generation gives the same 16 tokens.  Q8_0/Q4_0: llama.cpp quantizes
    activations to 8 bits for its products, so both differ from the file's
    float32 logits (cyformer's prefill widens the weights, its decode
    quantizes activations too); wherever the float32 reference's
    top token leads the runner-up by more than the two differences added,
    both pick it (on random weights, near ties make whole greedy
    continuations a matter of luck)."""
    llama_cpp = _llama_cpp()
    d = gpt2_dir[0] if which == "gpt2" else llama_dir[0]
    path = cyformer.load(d).save(str(tmp_path / "x.gguf"), format="gguf", dtype=qtype)
    ours = cyformer.load(path, threads=2)
    ref = cyformer.load(path, threads=2, dtype="float32")
    ids = _ids(ours)[:24]
    theirs = llama_cpp.Llama(path, n_ctx=128, n_threads=2, logits_all=True, verbose=False)
    theirs.eval(ids)
    lc = np.array(theirs.scores[:len(ids)], dtype=np.float32)
    got, want = ours.forward(ids), ref.forward(ids)
    e_lc, e_ours = np.abs(lc - want).max(), np.abs(got - want).max()
    if qtype == "f32":
        assert e_lc <= 1e-3 * np.abs(want).max(), e_lc
        gen = []
        for tok in theirs.generate(ids, temp=0.0, top_k=1, reset=True):
            gen.append(int(tok))
            if len(gen) == 16:
                break
        mine = list(ours.generate(ids, max_new_tokens=16))  # may stop early at eos
        assert gen[:len(mine)] == mine
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > e_lc + e_ours
    assert clear.sum() >= len(ids) // 2  # the check says something
    np.testing.assert_array_equal(lc.argmax(1)[clear], want.argmax(1)[clear])
    np.testing.assert_array_equal(got.argmax(1)[clear], want.argmax(1)[clear])


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_llama_cpp_greedy_equals_ours_on_a_block_file(tmp_path, qtype):
    """The bundled model as a Q8_0 / Q4_0 file: llama.cpp and cyformer (q8_0
    / q4_0 run from the file's records, int8 activation blocks in decode)
    generate the same 32 greedy tokens from each prompt.  (Each rounds differently --
    llama.cpp stores activation scales as fp16 and sums in its own order --
    so this holds where no step is a near tie, as on these prompts.)"""
    llama_cpp = _llama_cpp()
    path = cyformer.load().save(str(tmp_path / "m.gguf"), format="gguf", dtype=qtype)
    ours = cyformer.load(path, threads=2)
    assert ours.dtype == qtype
    theirs = llama_cpp.Llama(path, n_ctx=256, n_threads=2, verbose=False)
    for prompt in ("def fib(n):\n", "import os\n\nclass "):
        ids = ours.encode(prompt)
        gen = []
        for tok in theirs.generate(ids, temp=0.0, top_k=1, reset=True):
            gen.append(int(tok))
            if len(gen) == 32:
                break
        mine = list(ours.generate(ids, max_new_tokens=32, temperature=0))
        assert len(mine) == 32 and gen == mine, prompt


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_block_types_non_finite_block_scales(tmp_path, good, gpt2_dir, qtype):
    """A NaN or infinite fp16 scale in a Q8_0 / Q4_0 record would make every
    logit NaN: refused at load, naming the tensor (the records are checked as
    they are mapped)."""
    if qtype == "q4_0":
        good = cyformer.load(gpt2_dir[0]).save(str(tmp_path / "q4.gguf"), format="gguf", dtype="q4_0")
    t = next(t for t in gguf.GGUFReader(good).tensors if t.name == "blk.0.ffn_up.weight")
    for name, half in (("nan", b"\x00\x7e"), ("inf", b"\x00\x7c")):
        bad = _patch(good, tmp_path / f"{name}.gguf", int(t.data_offset) + {"q8_0": 34, "q4_0": 18}[qtype] * 5, half)
        with pytest.raises(ModelLoadError, match="blk.0.ffn_up.weight.*NaN or Inf block scales"):
            cyformer.load(bad)

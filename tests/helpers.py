"""Shared test utilities: random Hugging Face GPT-2 checkpoints on disk, and
the scripts of train/ as modules."""

import importlib.util
import json
import os
import sys

import numpy as np

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train")


def load_train_module(name):
    """train/<name>.py as the module train_<name> (the scripts import each
    other by name, so train/ goes on sys.path)."""
    if TRAIN not in sys.path:
        sys.path.insert(0, TRAIN)
    spec = importlib.util.spec_from_file_location(f"train_{name}", os.path.join(TRAIN, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def make_hf_checkpoint(path, seed=0, tokenizer_dir=None, **geometry):
    """Save a GPT2LMHeadModel with *every* tensor random (HF's init leaves
    biases at 0 and layer-norm gains at 1, which would hide bugs in them).

    Returns the HF model (eval mode) for reference computations.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    v = geometry.get("vocab_size", 50257)
    geometry.setdefault("bos_token_id", v - 1)
    geometry.setdefault("eos_token_id", v - 1)
    cfg = GPT2Config(**geometry)
    model = GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "transformer.ln_f.weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "wte" in name or "wpe" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                # ~1/sqrt(fan_in) keeps activations O(1) through the depth
                fan_in = p.shape[0] if p.ndim == 2 else 64
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer_dir is not None:
        import shutil
        shutil.copy(os.path.join(tokenizer_dir, "tokenizer.json"), path)
    return model


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        t = torch.as_tensor(np.atleast_2d(ids), dtype=torch.long)
        return model(t).logits.numpy()


def compare_logits(model, hf, ids, tol):
    """cyformer's logits for ids against transformers' (hf): max |difference|
    <= tol and the same argmax everywhere; returns cyformer's."""
    got = model.forward(ids)
    ref = hf_logits(hf, ids)
    ref = ref if np.ndim(ids) == 2 else ref[0]
    assert got.shape == ref.shape and got.dtype == np.float32
    diff = float(np.abs(got - ref).max())
    assert diff <= tol, f"max |logit diff| {diff:.3g} > {tol}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    return got


def edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(p, "w") as f:
        json.dump(cfg, f)


LLAMA_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "mistral": ("MistralConfig", "MistralForCausalLM")}


def make_hf_llama(path, model_type="llama", seed=0, **geometry):
    """Save a Llama-family model (LlamaForCausalLM, Qwen2ForCausalLM or
    MistralForCausalLM) with every tensor random, norm gains included.
    Returns the HF model (eval mode, float32)."""
    import torch
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in LLAMA_CLASSES[model_type])
    torch.manual_seed(seed)
    v = geometry.get("vocab_size", 128)
    geometry.setdefault("bos_token_id", 1)
    geometry.setdefault("eos_token_id", v - 1)
    cfg = cfg_cls(**geometry)
    model = model_cls(cfg).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name or name == "lm_head.weight":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:  # nn.Linear stores [out, in]: fan_in is the last axis
                fan_in = p.shape[-1] if p.ndim == 2 else 16
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(fan_in))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(model, ids, n):
    """transformers' greedy generate: the n new token ids."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.as_tensor([list(ids)]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()

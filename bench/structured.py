"""Constrained decoding libraries on CPU with cyformer's tokenizers.

    python bench/structured.py [--tokenizer PATH/tokenizer.json ...] [--repeats 5]

For llguidance, xgrammar and outlines-core: the time to prepare a tokenizer,
to compile a JSON schema (an object with strings, an integer, an enum and an
array), and to compute the allowed-token mask and advance by one token along
a fixed valid answer (its tokens as the tokenizer encodes it), per token,
median of --repeats passes.  Default tokenizers: the bundled model's and any
given with --tokenizer (e.g. one with a GPT-2-sized vocabulary).
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "role", "tags"], "additionalProperties": False}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"]}'


def llguidance_case(path):
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t = time.perf_counter()
    tok = llguidance.LLTokenizer(open(path).read())
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                                                 "key_separator": ": "})
    m = llguidance.LLMatcher(tok, grammar)
    assert not m.is_error(), m.get_error()
    t_compile = time.perf_counter() - t
    mask = allocate_token_bitmask(1, tok.vocab_size)

    def run(ids):
        m.reset()
        t = time.perf_counter()
        for i in ids:
            fill_next_token_bitmask(m, mask)
            assert (mask[0, i // 32] >> (i % 32)) & 1, "a token of the answer was masked"
            assert m.consume_token(i)
        return (time.perf_counter() - t) / len(ids)
    return t_tok, t_compile, run


def xgrammar_case(path):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=path)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=hf.backend_tokenizer.get_vocab_size())
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    m = xgr.GrammarMatcher(cg)
    t_compile = time.perf_counter() - t
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def run(ids):
        m.reset()
        t = time.perf_counter()
        for i in ids:
            m.fill_next_token_bitmask(mask)
            assert (int(mask[0, i // 32]) >> (i % 32)) & 1, "a token of the answer was masked"
            assert m.accept_token(i)
        return (time.perf_counter() - t) / len(ids)
    return t_tok, t_compile, run


def outlines_case(path):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tokenizers import Tokenizer

    t = time.perf_counter()
    tk = Tokenizer.from_file(path)
    eos = tk.token_to_id("<|endoftext|>")
    byte_dec = _byte_decoder()
    table = {}
    for s, i in tk.get_vocab().items():
        if i == eos:
            continue
        try:
            b = bytes(byte_dec[c] for c in s)
        except KeyError:
            continue
        table.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, table)
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    guide = Guide(index)
    t_compile = time.perf_counter() - t
    V = tk.get_vocab_size()
    mask = np.zeros((V + 31) // 32, dtype=np.int32)

    def run(ids):
        guide.reset()
        t = time.perf_counter()
        for i in ids:
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            assert (mask[i // 32] >> (i % 32)) & 1, "a token of the answer was masked"
            guide.advance(i, return_tokens=False)
        return (time.perf_counter() - t) / len(ids)
    return t_tok, t_compile, run


def _byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


CASES = {"llguidance": llguidance_case, "xgrammar": xgrammar_case, "outlines-core": outlines_case}


def main():
    from cyformer.loader import default_model_path
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", action="append", default=[])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    paths = [os.path.join(default_model_path(), "tokenizer.json")] + args.tokenizer
    print("| tokenizer (vocab) | library | tokenizer setup ms | schema compile ms | mask + advance us/token (median, range) |")
    print("|---|---|---|---|---|")
    for path in paths:
        tk = Tokenizer.from_file(path)
        ids = tk.encode(ANSWER).ids
        for name, case in CASES.items():
            try:
                t_tok, t_compile, run = case(path)
                per = sorted(run(ids) for _ in range(args.repeats))
            except Exception as e:  # noqa: BLE001 - report a library that fails, keep going
                print(f"| {os.path.basename(os.path.dirname(path))} ({tk.get_vocab_size()}) | {name} | failed: {e!r} | | |")
                continue
            print(f"| {os.path.basename(os.path.dirname(path))} ({tk.get_vocab_size()}) | {name} | {t_tok * 1e3:.0f} | "
                  f"{t_compile * 1e3:.1f} | {statistics.median(per) * 1e6:.0f} ({per[0] * 1e6:.0f}-{per[-1] * 1e6:.0f}) |")


if __name__ == "__main__":
    main()

"""The public Model: one interface over interchangeable backends.

A backend computes logits for new positions given a per-sequence cache
(``new_cache(capacity)``, ``run(ids, cache, last_only)``); the Model adds
input checking, batching, text and generation on top, identically for all.

For looking inside, a backend with ``supports_hooks`` (cyformer.backends.Backend) also takes
``run(..., hooks=HookPoints)``; ``run_with_cache`` and ``run_with_hooks``
go through it, and ``blocks``/``unembed`` are read-only views of the weights
(cyformer.interp).  TransformerLens's API is a layer above this class
(cyformer.tl wraps a Model); nothing here imports it.
"""

import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import _checks
from .backends import make_backend
from .config import Config
from .generate import GeneratedText, Generation, Stream
from .hooks import ActivationCache, HookOptions, HookPoints, select
from .model_files import GenerationConfig
from .processing import OPTIONS as PROCESSING_OPTIONS
from .request import CHAT_MAX_NEW_TOKENS, NOT_GIVEN, GenerationRequest
from .tokenizer import NoTokenizer
from .weights import Weights

# TransformerLens's names, which live on the layer above (a hint, not an API)
_LENS_NAMES = frozenset((
    "cfg", "to_tokens", "to_string", "to_str_tokens", "to_single_token", "to_single_str_token",
    "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "b_in", "W_gate", "W_out",
    "b_out", "W_E", "W_pos", "W_E_pos", "W_U", "b_U", "QK", "OV", "hook_dict", "mod_dict",
    "add_hook", "add_perma_hook", "reset_hooks", "hooks", "loss_fn", "set_use_attn_in",
    "set_use_split_qkv_input", "set_use_hook_mlp_in", "set_use_attn_result", "set_ln_normalized",
    "accumulated_bias", "tokens_to_residual_directions", "all_head_labels", "hook_points",
    "remove_all_hook_fns", "clear_contexts", "enable_compatibility_mode"))

# a prompt: text, token ids, or (for generate) several of either
Prompt = Union[str, Sequence[int], np.ndarray, Sequence[Any]]
# chat messages: [{"role": ..., "content": ...}, ...]
Messages = Sequence[Dict[str, Any]]


class Model:
    """A loaded model: embedding, blocks, final norm and unembedding.

    Build one with ``cyformer.load(path)``.  ``threads`` is the OpenMP team
    size every kernel call uses; results do not depend on it.
    TransformerLens's HookedTransformer surface wraps it:
    ``cyformer.tl.HookedTransformer(model)`` (cyformer.tl).
    """

    # set by cyformer.load for a GGUF file: per tensor kind, the file's type and
    # what runs (cyformer info), and the dtype it was loaded with (pickling)
    gguf_tensors: Optional[Dict[str, Any]] = None
    load_dtype: Optional[str] = None

    def __init__(self, cfg: Config, weights: Weights, threads=None, path=None, tokenizer=None,
                 backend="cython", generation_config: Optional[GenerationConfig] = None, reload=None):
        self.config = cfg
        # eos ids and default sampling values (generation_config.json)
        self.generation_config = generation_config if generation_config is not None else GenerationConfig()
        self.weights = weights
        # absolute from the start: a later os.chdir must not make save(),
        # pickle or copy read another directory's model
        self.path = None if path is None else os.path.abspath(os.fspath(path))
        self.tokenizer = tokenizer if tokenizer is not None else NoTokenizer(path)
        self.threads = _checks.threads("load", threads)
        self.backend = make_backend(backend, cfg, weights, self.threads)
        self._parts = None
        self._float_weights = None
        self.hook_options = HookOptions()  # optional hook points, what hook_normalized holds
        # weight processing applied (cyformer.processing): option -> bool
        self.processing = dict.fromkeys(PROCESSING_OPTIONS, False)
        # (path, threads, backend, dtype, processing) -> Model: cyformer.load passes
        # loader.reload, which pickling and copying call (the loader sits above this module)
        self._reload = reload

    @property
    def dtype(self) -> str:
        """The format of the weight matrices: "float32", "bfloat16", "int8", "int4", "q8_0" or "q4_0"."""
        from .weights import weight_format
        return weight_format(self.weights)

    @property
    def float_weights(self):
        """The weights with every matrix as float32 (the weights themselves
        for a float32 model; dequantized once, on first use, otherwise)."""
        if self._float_weights is None:
            from .weights import dequantized
            self._float_weights = dequantized(self.weights)
        return self._float_weights

    def save(self, directory: "str | os.PathLike[str]", format: str = "safetensors",
             dtype: Optional[str] = None) -> str:
        """Write the model, in its weight format, as a Hugging Face-style
        directory that ``cyformer.load(directory)`` maps without converting
        (config, tokenizer files, model.safetensors; cyformer.saving).

        format="gguf": one GGUF file at ``directory`` instead, every matrix
        in dtype "f32" (default), "f16", "q8_0" or "q4_0" (cyformer.gguf),
        which llama.cpp and ``cyformer.load`` read."""
        if format == "gguf":
            from .gguf import save as save_gguf
            return save_gguf(self, directory, dtype or "f32")
        if format != "safetensors" or dtype is not None:
            raise ValueError(f"save: format must be 'safetensors' or 'gguf' (dtype only with 'gguf'), "
                             f"got format={format!r}, dtype={dtype!r}")
        from .saving import save
        return save(self, directory)

    def __repr__(self):
        c = self.config
        kv = f" ({c.n_kv_head} key/value)" if c.n_kv_head != c.n_head else ""
        return (f"<cyformer.Model {c.model_type} {self.dtype} ({self.backend.name}) {c.n_layer} layers, "
                f"d_model {c.n_embd}, {c.n_head} heads{kv}, vocab {c.vocab_size}, context {c.n_positions}, "
                f"threads {self.threads}>")

    def __reduce__(self):
        # pickle, copy and deepcopy load the directory again: the weights are
        # memory-mapped and the compiled kernels hold pointers into them
        if self.path is None or self._reload is None:
            raise TypeError("a Model built from weights in memory cannot be pickled or copied: "
                            "only one loaded with cyformer.load(path) can (it is loaded again)")
        return self._reload, (os.path.abspath(self.path), self.threads, self.backend.name,
                              self.load_dtype or self.dtype,
                              dict(self.processing))

    def forward(self, ids: Union[Sequence[int], np.ndarray]) -> np.ndarray:
        """Logits for every position: ids [T] -> [T, V], or [B, T] -> [B, T, V] (float32).

        Each sequence runs from position 0 with its own cache; positions only
        see earlier ones (causal).
        """
        batch, batched = _checks.check_ids(ids, self.config)
        backend = self.backend
        if not batched:  # the backend's array as is (a [512, 50257] copy costs a layer norm pass)
            return backend.run(batch[0], backend.new_cache(batch.shape[1], reuse=True))
        return backend.forward_batch(batch)

    def __call__(self, ids, **options):
        """forward(ids)."""
        if options:
            raise TypeError(f"Model() takes token ids only, not {', '.join(options)}=: TransformerLens's "
                            "arguments belong to cyformer.tl.HookedTransformer(model)")
        return self.forward(ids)

    def __getattr__(self, name):
        if name in _LENS_NAMES:
            raise AttributeError(f"'Model' object has no attribute {name!r}: TransformerLens's names are on "
                                 f"the layer above, cyformer.tl.HookedTransformer(model) (NumPy) or "
                                 f"cyformer.tl.TransformerBridge (torch tensors)")
        raise AttributeError(f"'Model' object has no attribute {name!r}")

    # -- looking inside ---------------------------------------------------

    @property
    def blocks(self):
        """The blocks as objects to read: ``blocks[i].attn.heads[h]`` (W_Q, W_K,
        W_V, W_O, biases, qk_circuit(), ov_circuit()) and
        ``blocks[i].mlp.neurons[n]`` (read, bias, write); views of the weights."""
        if self._parts is None:
            from .parts import model_blocks
            self._parts = model_blocks(self.config, self.float_weights)
        return self._parts

    @property
    def unembed(self):
        """``unembed[token]`` -> that token's logit direction [C] (a row of lm_head, read-only)."""
        from .parts import Unembed
        return Unembed(self.float_weights.lm_head)

    def hook_names(self):
        """Every hook point's name, in the order the forward pass reaches them."""
        from .hooks import hook_names
        return hook_names(self.config, self.hook_options)

    def run_with_cache(self, ids: Union[Sequence[int], np.ndarray], names: Any = None,
                       fwd_hooks: Sequence[Any] = ()) -> "tuple[np.ndarray, ActivationCache]":
        """Logits plus the activations at the hook points: -> (logits, cache).

        ids [T] or [B, T] as for forward(), or a str (encoded as generate()
        encodes a prompt).  names selects what is kept: None (everything), a
        hook name, a list of names, or a predicate name -> bool; see
        ``hook_names()`` and cyformer.hooks for names and shapes.  The cache
        maps name -> float32 array, with a leading batch axis for 2-D ids.
        Only the requested points are computed apart from the fused kernels.
        fwd_hooks as in run_with_hooks() run first, so the cache shows what
        the model used.
        """
        record = select(self.config, names, "run_with_cache", self.hook_options)
        hooks = HookPoints(self.config, record, fwd_hooks, options=self.hook_options, fn="run_with_cache")
        logits = self.run_hooked(ids, hooks, "run_with_cache")
        batched = logits.ndim == 3
        cache = ActivationCache((n, v if batched else v[0]) for n, v in hooks.cache.items())
        cache.hook_names = self.hook_names()  # so a misspelt key gets the nearest names
        return logits, cache

    def run_with_hooks(self, ids: Union[Sequence[int], np.ndarray], fwd_hooks: Sequence[Any] = ()) -> np.ndarray:
        """Logits of a forward pass whose activations the hooks may change.

        fwd_hooks: pairs (name, fn), name a hook name or a predicate name ->
        bool.  ``fn(activation, name)`` gets the activation of one sequence
        (no batch axis; with 2-D ids it is called once per sequence);
        TransformerLens's ``fn(activation, hook)`` (a parameter named hook)
        gets the whole batch [B, ...] and the HookPoint.  Either returns None
        (keep it; the logits stay bitwise those of forward()) or a
        replacement of the same shape.  Several hooks on one point run in order.
        """
        hooks = HookPoints(self.config, frozenset(), fwd_hooks, options=self.hook_options)
        return self.run_hooked(ids, hooks)

    def run_hooked(self, ids, hooks, fn="run_with_hooks"):
        """The hooked forward pass under run_with_cache and run_with_hooks:
        ids [T] or [B, T] (or a str) through a cyformer.hooks.HookPoints,
        which runs its hooks and fills ``hooks.cache`` (every array with a
        leading batch axis) -> logits [T, V] or [B, T, V]."""
        if not self.backend.supports_hooks:
            raise ValueError(f"{fn}: the {self.backend.name!r} backend has no hook points; "
                             "load the model with backend='cython'")
        if not isinstance(hooks, HookPoints):
            raise TypeError(f"{fn}: hooks must be a cyformer.hooks.HookPoints, got {type(hooks).__name__}")
        if not isinstance(fn, str):
            raise TypeError(f"run_hooked: fn must be the caller's name (a str), got {type(fn).__name__}")
        if isinstance(ids, str):
            ids = self.tokenizer.encode(ids, add_special_tokens=True)
        batch, batched = _checks.check_ids(ids, self.config, fn)
        logits = np.stack(self.backend.run_hooked_batch(batch, hooks))
        return logits if batched else logits[0]

    # -- text -------------------------------------------------------------

    def encode(self, text: str) -> List[int]:
        """str -> list of token ids (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.encode(text)

    def decode(self, ids: Union[Sequence[int], np.ndarray]) -> str:
        """token ids -> str (needs the checkpoint's tokenizer.json)."""
        return self.tokenizer.decode(_checks.token_ids("decode", "ids", ids, self.config.vocab_size, ndim=1))

    # -- generation -------------------------------------------------------

    def generate(self, prompt: Prompt, max_new_tokens: Any = NOT_GIVEN, *,
                 request: Optional[GenerationRequest] = None, cache_names: Any = None,
                 **options: Any) -> Any:
        """Continue ``prompt`` (a str, or a sequence of token ids).

        Returns the new text (a str with ``.token_ids``, ``.finish_reason`` and
        ``.stats``) for a str prompt, or the new token ids (a list with
        ``.finish_reason`` and ``.stats``) for an ids prompt.

        The options are cyformer.request.GenerationRequest's fields, given as
        keywords (``temperature=0.7, stop=["\\n\\n"], seed=1``) or as one
        ``request`` (keywords then override its fields); max_new_tokens
        defaults to 64.  temperature 0 is greedy; ``seed`` makes sampling
        reproducible.  A sampling option not given takes the checkpoint's value
        from generation_config.json (``generation_config.sampling()``);
        without that file, greedy with no filters; None switches a filter off.
        A str prompt is encoded as transformers does (with bos where the
        tokenizer adds one).  It stops at max_new_tokens ("length"), an eos
        token ("eos": config.json's eos_token_id, or generation_config.json's
        list), a stop string or stop token id ("stop"; a stop string is cut
        from the text), or when the n_positions context is full ("context").
        A prompt longer than the context is refused unless ``truncate=True``,
        which keeps its last ``n_positions - max_new_tokens`` tokens (at least
        one) when prompt and new tokens would not fit;
        ``.stats["truncated_tokens"]`` counts the dropped ones.  Only the
        continuation is returned, never the prompt.

        Several prompts (a list of str or of id lists, a 2-D id array) run
        together through the batched engine (cyformer.engine) and give a list
        of results, each equal to generating from that prompt alone.
        max_new_tokens, temperature, top_k, top_p, repetition_penalty and seed
        may then be lists with one value per prompt, and a prompt may be a
        dict {"prompt": ..., "stop": ..., any other option} of its own.

        logprobs=True gives the result ``.logprobs``: per generated token a
        TokenLogprob (token, logprob, top), where top holds the
        ``top_logprobs`` most likely tokens as (id, logprob) pairs; by default
        the model's own log-probabilities (log_softmax of the logits, before
        any sampling option), with logprobs_mode="processed" those of the
        scores sampled from.

        cache_names (a list of hook names or a predicate, as run_with_cache's
        names) also records those activations for every position of the
        prompt and of each generated token, from the cached decode itself;
        the result's ``.cache`` maps name -> array with all positions
        concatenated (attention scores and patterns [H, positions, positions],
        earlier steps' key axes padded with -inf and 0: the causal mask).  The
        last generated token is fed once more to fill its position, unless the
        context is full.  Without cache_names ``.cache`` is None.
        """
        from .engine import batch_generations, is_batch, run_batch

        if is_batch(prompt):
            if cache_names is not None:
                raise ValueError("generate: cache_names takes one prompt, not a list of them")
            return run_batch(self, batch_generations(self, prompt, request, max_new_tokens, options))
        req = GenerationRequest.build(request, max_new_tokens, **options)
        return Generation(self, prompt, req, cache_names=cache_names).result()

    def score(self, text: Union[str, Sequence[int], np.ndarray]) -> np.ndarray:
        """Per-token log-likelihoods of a given text (a str, encoded as a
        prompt, or token ids [T]): float64 [T - 1], entry i the log-probability
        of token i + 1 after tokens 0..i (log_softmax in float64).  The first
        token has no prediction; ``model.encode`` shows the ids of a str."""
        ids = self.tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else text
        ids = _checks.token_ids("score", "text", ids, self.config.vocab_size, ndim=1)
        if ids.size == 0:
            raise ValueError("score: the text holds no tokens")
        from .sampling import log_softmax

        logits = self.forward(ids)
        out = np.empty(ids.size - 1, dtype=np.float64)
        for t0 in range(0, ids.size - 1, 64):  # float64 rows in blocks: [T, V] of them can be GBs
            t1 = min(t0 + 64, ids.size - 1)
            out[t0:t1] = log_softmax(logits[t0:t1])[np.arange(t1 - t0), ids[t0 + 1:t1 + 1]]
        return out

    def stream(self, prompt: Prompt, max_new_tokens: Any = NOT_GIVEN, *,
               request: Optional[GenerationRequest] = None, **options: Any) -> Stream:
        """Like generate(), but yields pieces as they are produced: str pieces
        (never splitting a UTF-8 character) for a str prompt, int ids for an
        ids prompt.  The returned iterator has ``finish_reason`` once exhausted."""
        return Stream(Generation(self, prompt, GenerationRequest.build(request, max_new_tokens, **options)))

    def chat(self, messages: Messages, max_new_tokens: Any = NOT_GIVEN, *,
             request: Optional[GenerationRequest] = None,
             template_vars: Optional[Dict[str, Any]] = None, **options: Any) -> GeneratedText:
        """The assistant's reply to ``messages`` ([{"role": ..., "content": ...}, ...]),
        rendered with the checkpoint's chat template (cyformer.chat) and ended
        at its end-of-turn token.  Options as for generate(), max_new_tokens
        defaulting to 256; returns its result type for a str prompt."""
        from .chat import chat_generation
        req = GenerationRequest.build(request, max_new_tokens, CHAT_MAX_NEW_TOKENS, **options)
        return chat_generation(self, messages, req, template_vars).result()

    def chat_stream(self, messages: Messages, max_new_tokens: Any = NOT_GIVEN, *,
                    request: Optional[GenerationRequest] = None,
                    template_vars: Optional[Dict[str, Any]] = None, **options: Any) -> Stream:
        """Like chat(), but yields the reply's str pieces as stream() does."""
        from .chat import chat_generation
        req = GenerationRequest.build(request, max_new_tokens, CHAT_MAX_NEW_TOKENS, **options)
        return Stream(chat_generation(self, messages, req, template_vars))

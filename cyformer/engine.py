"""Many generations at once: continuous batching over one model.

Decode reads every weight for each token, so sequences that decode together
can share that read: each step of the scheduler feeds one new token of every
active sequence through ``backend.step_batch`` (B tokens, B caches, each at
its own position).  Requests join between steps and leave as soon as they
end, so a short reply never waits for a long one.

A new sequence's prompt is prefilled in pieces of at most ``prefill_chunk``
positions per step, so a long prompt delays the others' next token by one
piece, not by the whole prompt.  Pieces are never shorter than the backend's
``exact_chunk``: such pieces are bitwise one prefill, so a sequence's logits,
and with them its tokens, are those of ``Model.generate`` on the prompt alone.
With a PrefixCache, a prompt that starts like an earlier one copies those
keys and values and prefills only the rest.

KV memory is a budget (``kv_cache_mb``): a sequence's cache grows with the
tokens it holds (kv_cache.py), a request is admitted only when its prompt's
cache fits beside the running ones, and when a running sequence cannot grow
the most recently admitted other one is preempted: its cache is dropped and
it waits at the front of the queue, to prefill its prompt and the tokens it
has generated so far when memory frees (vLLM's recompute preemption).  A
preempted sequence's later tokens come from recomputed keys and values,
which agree with the decoded ones to rounding, not bitwise.

Every sampling choice is made by a per-request ``Decoding`` (generate.py)
with its own seeded generator, so batching changes no result.

    engine = Engine(model)
    stream = engine.generate("def fib(n):", max_new_tokens=32)
    for event in stream:            # Event(token, text, logprob)
        print(event.text, end="")
    engine.close()

``Model.generate([p1, p2, ...])`` runs the same Scheduler in the calling
thread.  Engine runs it in one background thread and takes requests from any
thread.
"""

import queue
import threading
from collections import deque
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import numpy as np

from . import _checks, _openmp
from .errors import CyformerError
from .generate import CANCELLED, CONTEXT, Decoding, Finished, Generation, TokenLogprob
from .kv_cache import GROW_MIN, KVCache, ROUND
from .request import CHAT_MAX_NEW_TOKENS, NOT_GIVEN, GenerationRequest
from .prefix_cache import DEFAULT_MB, PrefixCache

MAX_BATCH = 16        # sequences decoded together
MAX_QUEUE = 512       # requests waiting for a slot before submit() refuses more (a few KB each)
PREFILL_CHUNK = 256   # prompt positions prefilled per step, over all new sequences


def default_kv_cache_mb():
    """A quarter of the machine's physical memory, in MB (4096 where it cannot be read)."""
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 4 / 2**20
    except (ValueError, OSError, AttributeError):
        return 4096.0


# a stream's callback: each Event of its generation, then None, in the scheduler's thread
Sink = Callable[[Optional["Event"]], Any]


class EngineBusy(CyformerError):
    """The engine's queue is full: try again later."""


class EngineClosed(CyformerError):
    """The engine is shutting down and takes no new requests."""


class SinkError(CyformerError):
    """A stream's sink raised: that stream ended with this error (its
    ``__cause__`` is the sink's exception); no other stream is affected."""


class Event(NamedTuple):
    """One step of a stream: a generated token (None for text held back until
    the end), its text piece ('' while held back) and its TokenLogprob (None
    unless logprobs were asked for)."""

    token: Optional[int]
    text: str
    logprob: Optional[TokenLogprob]


_END = object()


class EngineStream(Finished):
    """One request's events, handed over from the scheduler's thread.

    Iterate it for Events (it ends when the generation does), or call
    ``result()`` for the whole GeneratedText / GeneratedIds.  ``cancel()``
    ends the generation at the scheduler's next step and frees its slot
    and cache.  With ``sink``, events go to ``sink(event)`` instead (in the
    scheduler's thread; ``sink(None)`` at the end) and the stream is not
    iterated: the server bridges them into its event loop this way.

    A sink is the caller's code running in the scheduler's thread, so it is
    isolated there: if it raises, its stream is cancelled and ends with a
    SinkError (the sink gets no more events, then ``None``), and the other
    streams go on.  A sink may submit new requests, but not wait for one
    (``result``, ``wait`` or iterating a stream): that would stop the very
    thread that makes progress, so it raises RuntimeError at once.
    """

    def __init__(self, generation: Generation, sink=None, scheduler_thread=None):
        self.generation = generation
        self.decoding = Decoding(generation)
        self._sink = sink
        self._sink_error = None  # what the sink raised, if it did
        self._scheduler_thread = scheduler_thread  # None: run in the caller's thread (run_batch)
        self._events: "Optional[queue.SimpleQueue[Event]]" = queue.SimpleQueue() if sink is None else None
        self._cancel = threading.Event()
        self._done = threading.Event()
        self.error = None  # the exception that ended it, if one did
        self.resume_ids = None  # after preemption: the ids to prefill again
        self.preemptions = 0    # times its cache was dropped to be recomputed

    # -- the scheduler's side --

    def _call_sink(self, event):
        if self._sink_error is not None and event is not None:
            return  # a sink that raised gets nothing more but the end
        try:
            self._sink(event)
        except Exception as e:  # noqa: BLE001 - the caller's code must not stop the scheduler
            if self._sink_error is None:
                self._sink_error = e
                self._cancel.set()  # the scheduler retires it at its next step

    def _emit(self, pairs):
        logprobs = self.generation.logprobs
        for tok, piece in pairs:
            lp = logprobs[-1] if (logprobs and tok is not None) else None
            event = Event(tok, piece, lp)
            if self._sink is not None:
                self._call_sink(event)
            else:
                self._events.put(event)

    def _sink_failure(self):
        """The SinkError that ends a stream whose sink raised (None if it did not)."""
        if self._sink_error is None:
            return None
        error = SinkError(f"the stream's sink raised {type(self._sink_error).__name__}: "
                          f"{str(self._sink_error)[:200]}")
        error.__cause__ = self._sink_error
        return error

    def _close(self, error=None):
        self.error = error if error is not None else self._sink_failure()
        self._done.set()
        if self._sink is not None:
            self._call_sink(None)
        else:
            self._events.put(_END)

    def _check_not_scheduler(self, what):
        if self._scheduler_thread is not None and threading.current_thread() is self._scheduler_thread:
            raise RuntimeError(f"EngineStream.{what}: called from a sink, in the engine's scheduler "
                               "thread, which would wait for itself; a sink may submit requests but "
                               "not wait for them")

    # -- the caller's side --

    def __iter__(self):
        return self

    def __next__(self):
        if self._events is None:
            raise TypeError("this stream delivers its events to a sink")
        self._check_not_scheduler("__next__")
        item = self._events.get()
        if item is _END:
            self._events.put(_END)  # later calls end too
            if self.error is not None:
                raise self.error
            raise StopIteration
        return item

    def cancel(self):
        """Stop generating; the scheduler frees the slot at its next step."""
        self._cancel.set()

    @property
    def cancelled(self):
        return self._cancel.is_set()

    def done(self):
        return self._done.is_set()

    def wait(self, timeout=None):
        """Block until the generation has ended; False on timeout."""
        if not self._done.is_set():
            self._check_not_scheduler("wait")
        return self._done.wait(timeout)

    def result(self, timeout=None):
        """The finished GeneratedText or GeneratedIds (blocks until then)."""
        if not self.wait(timeout):
            raise TimeoutError(f"the generation did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.generation.output()



class _Sequence:
    """A stream admitted to the batch: its cache, the ids not yet prefilled,
    and whether it resumes after preemption (its last logits were used already)."""

    __slots__ = ("stream", "kv", "pending", "resumed")

    def __init__(self, stream, kv, pending, resumed=False):
        self.stream, self.kv, self.pending, self.resumed = stream, kv, pending, resumed


class Scheduler:
    """Admits, prefills, steps and retires sequences; not thread-safe (Engine
    drives it from one thread, Model.generate from the caller's)."""

    def __init__(self, model, max_batch=MAX_BATCH, prefill_chunk=PREFILL_CHUNK, prefix_cache=None,
                 kv_cache_mb=None):
        self.model = model
        self.backend = model.backend
        self.max_batch = _positive("max_batch", max_batch)
        self.prefill_chunk = _positive("prefill_chunk", prefill_chunk)
        if kv_cache_mb is None:
            kv_cache_mb = default_kv_cache_mb()
        if isinstance(kv_cache_mb, bool) or not isinstance(kv_cache_mb, (int, float)) or not kv_cache_mb > 0:
            raise ValueError(f"Engine: kv_cache_mb must be a number of MB > 0, got {kv_cache_mb!r}")
        self.kv_budget = int(kv_cache_mb * 2**20)
        # None: this backend's pieces are not bitwise one prefill; prefill whole.
        self.exact = self.backend.exact_chunk
        self.prefix_cache = prefix_cache if self.exact is not None else None
        self.waiting = deque()
        self.active = []
        self.counts = {"steps": 0, "admitted": 0, "finished": 0, "cancelled": 0, "failed": 0,
                       "prompt_tokens": 0, "prefilled_tokens": 0, "generated_tokens": 0,
                       "batched_tokens": 0, "preempted": 0, "kv_peak_bytes": 0}

    @property
    def busy(self):
        return bool(self.waiting or self.active)

    def add(self, stream: EngineStream):
        self.waiting.append(stream)

    def cancel_all(self):
        for stream in list(self.waiting) + [s.stream for s in self.active]:
            stream.cancel()

    def step(self):
        """One round: drop cancelled requests, admit waiting ones, prefill a
        piece of new prompts, and decode one token of every running sequence."""
        self._drop_cancelled()
        self._admit()
        decoding = [s for s in self.active if s.pending.size == 0]
        self._prefill()
        self._decode(decoding)
        self.counts["steps"] += 1

    # -- the stages --

    def _drop_cancelled(self):
        for stream in [st for st in self.waiting if st.cancelled]:
            self.waiting.remove(stream)
            self._retire(stream, CANCELLED)
        for seq in [s for s in self.active if s.stream.cancelled]:
            self._finish(seq, CANCELLED)

    def kv_bytes(self):
        """Bytes the running sequences' caches hold."""
        return sum(getattr(s.kv, "nbytes", 0) for s in self.active if s.kv is not None)

    def kv_positions(self):
        """Positions the running sequences' caches hold filled."""
        return sum(s.kv.length for s in self.active if isinstance(s.kv, KVCache))

    def _admit(self):
        cfg = self.model.config
        while self.waiting and len(self.active) < self.max_batch:
            stream = self.waiting[0]
            g = stream.generation
            resumed = stream.resume_ids is not None
            ids = stream.resume_ids if resumed else g.prompt_ids
            try:
                kv = self.backend.new_cache(min(cfg.n_positions, g.prompt_ids.size + g.max_new_tokens))
                if isinstance(kv, KVCache):
                    # room for the prompt (and a little more): the rest comes as it decodes
                    cap = min(kv.limit, -(-(ids.size + GROW_MIN // 4) // ROUND) * ROUND)
                    need = kv.bytes_at(cap)
                    if self.kv_bytes() + need > self.kv_budget:
                        if self.active:
                            return  # wait for memory, in order
                        raise MemoryError(f"the prompt needs {need / 2**20:.1f} MB of KV cache, more than "
                                          f"the whole budget of {self.kv_budget / 2**20:.1f} MB (kv_cache_mb)")
                    kv.reserve(ids.size, capacity=cap)
                reused = 0
                if self.prefix_cache is not None and isinstance(kv, KVCache):
                    # leave at least one exact piece to prefill: its rows match a whole prefill
                    reused = self.prefix_cache.lookup(ids, kv, keep=self.exact)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                self.waiting.popleft()
                self._retire(stream, error=e)
                continue
            self.waiting.popleft()
            self.active.append(_Sequence(stream, kv, ids[reused:], resumed))
            self._note_kv()
            if resumed:
                stream.resume_ids = None
            else:
                self.counts["admitted"] += 1
                self.counts["prompt_tokens"] += int(g.prompt_ids.size)

    def _note_kv(self):
        self.counts["kv_peak_bytes"] = max(self.counts["kv_peak_bytes"], self.kv_bytes())

    def _make_room(self, seqs):
        """Grow the caches of the sequences about to decode by one position,
        within the budget, preempting the most recently admitted others when
        it is full; returns the sequences that can step."""
        ready = []
        for seq in seqs:
            kv = seq.kv
            if seq not in self.active or not isinstance(kv, KVCache) or kv.length + 1 <= kv.capacity:
                if seq in self.active:
                    ready.append(seq)
                continue
            n = kv.length + 1
            while True:
                used = self.kv_bytes() - kv.nbytes
                cap = next((c for c in (kv.grown(n), min(kv.limit, -(-n // ROUND) * ROUND))
                            if used + kv.bytes_at(c) <= self.kv_budget), None)
                if cap is not None:
                    kv.reserve(n, capacity=cap)
                    ready.append(seq)
                    break
                victim = next((s for s in reversed(self.active) if s is not seq), None)
                if victim is None:
                    # alone and still out of memory: the budget is its context
                    seq.stream.decoding.next_token = None
                    self._finish(seq, CONTEXT)
                    break
                self._preempt(victim)
                if victim in ready:
                    ready.remove(victim)
        self._note_kv()
        return ready

    def _preempt(self, seq):
        """Drop a sequence's cache and queue it first, to recompute later."""
        g = seq.stream.generation
        self.active.remove(seq)
        seq.kv = None
        stream = seq.stream
        if stream.decoding.next_token is not None or seq.resumed:
            # prompt + every generated token but the last, which is fed next
            stream.resume_ids = np.concatenate([g.prompt_ids, np.array(g.tokens[:-1], dtype=np.int64)])
        else:
            # still prefilling its prompt: start it again from the beginning
            self.counts["admitted"] -= 1
            self.counts["prompt_tokens"] -= int(g.prompt_ids.size)
        self.waiting.appendleft(stream)
        stream.preemptions += 1
        self.counts["preempted"] += 1

    def _piece(self, remaining, budget):
        """How many of ``remaining`` prompt positions to prefill now."""
        if self.exact is None or remaining <= budget:
            return remaining
        n = max(budget, self.exact)
        return remaining if remaining - n < self.exact else n

    def _prefill(self):
        budget = self.prefill_chunk
        for seq in [s for s in self.active if s.pending.size]:
            if budget <= 0:
                break
            n = self._piece(seq.pending.size, budget)
            budget -= n
            piece, seq.pending = seq.pending[:n], seq.pending[n:]
            try:
                logits = self.backend.run(piece, seq.kv, last_only=True)[-1]
                self.counts["prefilled_tokens"] += n
                if seq.pending.size:
                    continue
                if seq.resumed:  # its next token was chosen before it was preempted
                    continue
                kv = seq.kv  # _push may retire the sequence (and drop seq.kv)
                self._push(seq, logits)
                # after the first token is out: copying the prompt's keys and values
                # into the prefix cache is not the caller's wait
                self._remember(seq.stream.generation.prompt_ids, kv)
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)

    def _remember(self, ids, kv):
        """Offer a prefilled prompt's keys and values to the prefix cache."""
        if self.prefix_cache is not None and isinstance(kv, KVCache) and ids.size >= self.exact:
            self.prefix_cache.store(ids, kv)

    def _decode(self, seqs):
        seqs = [s for s in seqs if s in self.active and s.stream.decoding.next_token is not None]
        seqs = self._make_room(seqs)
        if not seqs:
            return
        tokens = np.array([s.stream.decoding.next_token for s in seqs], dtype=np.int64)
        try:
            logits = self.backend.step_batch(tokens, [s.kv for s in seqs])
        except Exception as e:  # noqa: BLE001
            for s in seqs:
                self._fail(s, e)
            return
        self.counts["batched_tokens"] += len(seqs)
        for b, seq in enumerate(seqs):
            try:
                self._push(seq, logits[b])
            except Exception as e:  # noqa: BLE001
                self._fail(seq, e)

    def _push(self, seq, logits):
        """Hand the logits of a sequence's last position to its Decoding."""
        stream = seq.stream
        n0 = len(stream.generation.tokens)
        stream._emit(stream.decoding.push(logits))
        self.counts["generated_tokens"] += len(stream.generation.tokens) - n0
        if stream.decoding.next_token is None:
            self._finish(seq)

    def _finish(self, seq, reason=None):
        self.active.remove(seq)
        seq.kv = None  # the cache's memory goes back now, not when the caller lets go
        self._retire(seq.stream, reason)

    def _fail(self, seq, error):
        if seq in self.active:
            self.active.remove(seq)
        seq.kv = None
        self._retire(seq.stream, error=error)

    def fail_all(self, error):
        """End every waiting and running sequence with ``error`` (the engine's
        own failure, outside any one request)."""
        for seq in list(self.active):
            self._fail(seq, error)
        while self.waiting:
            self._retire(self.waiting.popleft(), error=error)

    def _retire(self, stream, reason=None, error=None):
        if error is None:
            error = stream._sink_failure()  # its own sink ended it: an error, not a cancel
        if error is not None:
            self.counts["failed"] += 1
            stream.decoding.finish("error")
        else:
            if reason == CANCELLED:
                self.counts["cancelled"] += 1
            else:
                self.counts["finished"] += 1
            stream._emit(stream.decoding.finish(reason))
        stream._close(error)


def _positive(name, value):
    value = _checks.integer("Engine", name, value)
    if value < 1:
        raise ValueError(f"Engine: {name} must be >= 1, got {value}")
    return value


class Engine:
    """Takes generation requests from any thread and runs them together.

    max_batch: sequences decoded together; max_queue: requests waiting for
    a slot before ``generate`` raises EngineBusy; prefill_chunk: prompt
    positions prefilled per step; prefix_cache_mb: the prefix cache's memory
    bound (0 turns it off; only the cython backend has one); kv_cache_mb: the
    running sequences' KV caches' memory bound (default: a quarter of the
    machine's memory): requests wait, and running ones are preempted and
    recomputed later, rather than exceed it.  One scheduler
    thread does all the model's work.  Use as a context manager, or call
    ``close()``.
    """

    def __init__(self, model, *, max_batch=MAX_BATCH, max_queue=MAX_QUEUE, prefill_chunk=PREFILL_CHUNK,
                 prefix_cache_mb=DEFAULT_MB, kv_cache_mb=None):
        self.model = model
        self.max_queue = _positive("max_queue", max_queue)
        self.prefix_cache = PrefixCache(prefix_cache_mb) if prefix_cache_mb else None
        self.scheduler = Scheduler(model, max_batch, prefill_chunk, self.prefix_cache, kv_cache_mb)
        self._cond = threading.Condition()
        self._incoming = []
        self._closing = False
        self._cancel_all = False
        # the kernels run on the engine's thread from here: the team this
        # thread's earlier calls left (a generate() first) would make every
        # parallel region of the engine's a sleep and a wake-up (_openmp)
        _openmp.release_this_thread()
        self._thread = threading.Thread(target=self._loop, name="cyformer-engine", daemon=True)
        self._thread.start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(cancel=True)

    # -- requests --

    def generate(self, prompt: Any, max_new_tokens: Any = NOT_GIVEN, *,
                 request: Optional[GenerationRequest] = None, sink: Optional[Sink] = None,
                 **options: Any) -> "EngineStream":
        """Queue a generation (arguments as Model.generate); returns its EngineStream.
        Raises ValueError for bad arguments, EngineBusy when the queue is full."""
        g = Generation(self.model, prompt, GenerationRequest.build(request, max_new_tokens, **options))
        return self.submit([g], sink)[0]

    def chat(self, messages: Sequence[Dict[str, Any]], max_new_tokens: Any = NOT_GIVEN, *,
             request: Optional[GenerationRequest] = None, template_vars: Optional[Dict[str, Any]] = None,
             sink: Optional[Sink] = None, **options: Any) -> "EngineStream":
        """Queue the assistant's reply to ``messages`` (as Model.chat); returns its EngineStream."""
        from .chat import chat_generation
        req = GenerationRequest.build(request, max_new_tokens, CHAT_MAX_NEW_TOKENS, **options)
        return self.submit([chat_generation(self.model, messages, req, template_vars)], sink)[0]

    def submit(self, generations: Sequence[Generation],
               sink: Union[None, Sink, Sequence[Optional[Sink]]] = None) -> "List[EngineStream]":
        """Queue Generations (all or none); returns their EngineStreams.
        sink: one callable for all of them, or a list with one per generation."""
        if not isinstance(generations, (list, tuple)) or not all(isinstance(g, Generation) for g in generations):
            raise TypeError("submit: generations must be a list of Generation objects "
                            "(Engine.generate and Engine.chat make one from a prompt)")
        generations = list(generations)
        sinks = list(sink) if isinstance(sink, (list, tuple)) else [sink] * len(generations)
        if len(sinks) != len(generations):
            raise ValueError(f"submit: {len(sinks)} sinks for {len(generations)} generations "
                             "(give one sink for all, or one per generation)")
        for s in sinks:
            if s is not None and not callable(s):
                raise TypeError(f"submit: a sink must be callable or None, got {type(s).__name__}")
        streams = [EngineStream(g, s, self._thread) for g, s in zip(generations, sinks)]
        with self._cond:
            if self._closing or not self._thread.is_alive():
                raise EngineClosed("the engine is shutting down")
            if self.queue_depth + len(streams) > self.max_queue:
                raise EngineBusy(f"the queue is full ({self.max_queue} requests waiting); try again later")
            self._incoming.extend(streams)
            self._cond.notify()
        return streams

    @property
    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return len(self._incoming) + len(self.scheduler.waiting)

    @property
    def active(self) -> int:
        """Sequences in the batch (prefilling or decoding)."""
        return len(self.scheduler.active)

    def stats(self) -> Dict[str, Any]:
        """Counters and gauges: queue_depth, active, steps, admitted, finished,
        cancelled, failed, preempted, prompt/prefilled/generated tokens,
        kv_cache (bytes, max_bytes, peak_bytes, positions), prefix_cache."""
        sched = self.scheduler
        out = dict(sched.counts)
        peak = out.pop("kv_peak_bytes")
        out.update(queue_depth=self.queue_depth, active=self.active, max_batch=sched.max_batch,
                   max_queue=self.max_queue)
        # read from another thread while the scheduler runs: a snapshot, not a sum it holds
        active = list(sched.active)
        kvs = [s.kv for s in active]
        out["kv_cache"] = {"bytes": sum(getattr(kv, "nbytes", 0) for kv in kvs if kv is not None),
                           "positions": sum(kv.length for kv in kvs if isinstance(kv, KVCache)),
                           "max_bytes": sched.kv_budget, "peak_bytes": peak}
        out["prefix_cache"] = self.prefix_cache.stats() if self.prefix_cache is not None else None
        return out

    # -- the scheduler thread --

    def _loop(self):
        sched = self.scheduler
        while True:
            with self._cond:
                while not self._incoming and not sched.busy and not self._closing:
                    self._cond.wait()
                for stream in self._incoming:
                    sched.add(stream)
                self._incoming.clear()
                if self._cancel_all:
                    sched.cancel_all()
                if self._closing and not sched.busy:
                    return
            try:
                sched.step()
            except Exception as e:  # noqa: BLE001 - fail what is in flight, keep serving the rest
                sched.fail_all(e)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, cancel: bool = False, timeout: Optional[float] = None) -> bool:
        """Stop taking requests; finish the queued and running ones (or cancel
        them with cancel=True); wait up to ``timeout`` s for the scheduler
        thread to end.  Returns True once it has ended.  From a sink (the
        scheduler's own thread) it does not wait, and returns False."""
        with self._cond:
            self._closing = True
            self._cancel_all = self._cancel_all or cancel
            self._cond.notify()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()


# -- Model.generate with a list of prompts --

PER_PROMPT = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed")


def is_batch(prompt):
    """Whether a generate() prompt is several prompts: a list of str, of id
    sequences or of dicts, or a 2-D array of ids."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 2
    if isinstance(prompt, (list, tuple)) and prompt:
        return all(isinstance(p, (str, dict, list, tuple, np.ndarray)) for p in prompt)
    return False


def batch_generations(model, prompts, request=None, max_new_tokens=NOT_GIVEN, options=None):
    """One Generation per prompt, from ``request`` and the keyword ``options``
    (GenerationRequest's fields).  A value in PER_PROMPT (max_new_tokens
    included) may be a list with one entry per prompt; a prompt may be a dict
    {"prompt": ..., option: value} that overrides any option for itself (stop
    lists go there, since a list-valued stop is already one prompt's list of
    stop strings)."""
    prompts = list(prompts)
    options = dict(options or {})
    if max_new_tokens is not NOT_GIVEN:
        options["max_new_tokens"] = max_new_tokens
    keys = frozenset(GenerationRequest.fields()) | {"prompt"}
    for name in PER_PROMPT:
        v = options.get(name)
        if isinstance(v, (list, tuple)) and len(v) != len(prompts):
            raise ValueError(f"generate: {name} has {len(v)} values for {len(prompts)} prompts")
    gens = []
    for i, p in enumerate(prompts):
        mine = {k: (v[i] if k in PER_PROMPT and isinstance(v, (list, tuple)) else v) for k, v in options.items()}
        if isinstance(p, dict):
            unknown = set(p) - keys
            if unknown or "prompt" not in p:
                raise ValueError(f"generate: prompt {i} is a dict; it needs 'prompt' and may set "
                                 f"{', '.join(sorted(keys - {'prompt'}))}"
                                 + (f"; unknown: {', '.join(sorted(map(str, unknown)))}" if unknown else ""))
            mine.update((k, v) for k, v in p.items() if k != "prompt")
            p = p["prompt"]
        try:
            gens.append(Generation(model, p, GenerationRequest.build(request, **mine)))
        except ValueError as e:
            raise ValueError(f"generate: prompt {i}: {e}") from None
    return gens


def run_batch(model, generations, max_batch=32):
    """Run Generations together in the calling thread; their results in order."""
    sched = Scheduler(model, max_batch=max_batch)
    streams = [EngineStream(g) for g in generations]
    for s in streams:
        sched.add(s)
    while sched.busy:
        sched.step()
    return [s.result() for s in streams]


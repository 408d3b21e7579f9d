"""The OpenMP runtime of this process, and what a fork does to it.

cyformer._checks, through which every kernel call gets its thread count,
imports it, so the fork handler is in place before any kernel runs.

Fork.  libgomp has no fork handler: a child forked after a parallel region
inherits a team of worker threads that no longer exist and waits for them
forever at its first parallel region.  Before every os.fork (multiprocessing
and ProcessPoolExecutor included) the forking thread's workers are ended
(OpenMP 5.0's omp_pause_resource_all; the next parallel region in the parent
starts them again), so the child starts its own.  Where that is not possible
(a libgomp older than GCC 9) the child runs every kernel on one thread:
``_checks.threads`` reads ``one_thread``.
"""

import os

from . import _runtime

one_thread = False      # True in a child forked while worker threads could not be ended
_released = True        # whether the last fork's before-handler ended them


def _before_fork():
    global _released
    _released = one_thread or _runtime.release_threads() == 0


def _after_fork_in_child():
    global one_thread
    one_thread = one_thread or not _released


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def release_this_thread():
    """End the worker threads of this thread's OpenMP team (the next kernel
    call from this thread starts them again).

    libgomp counts every thread it keeps, idle teams of other Python threads
    included, and once that count passes the CPUs its threads spin ~100
    times and then sleep before every parallel region: a wake-up per kernel
    call.  A thread about to hand the kernels to another one (the Engine's)
    calls this, so the idle team it left does not slow that one."""
    if not one_thread:
        _runtime.release_threads()


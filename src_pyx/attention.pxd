# Causal multi-head self-attention over a key/value cache.
# This is the only module where positions mix.

# Floats of scratch per thread for a cache of `cap` positions.
cdef Py_ssize_t attention_scratch_size(Py_ssize_t cap, Py_ssize_t d_head) noexcept nogil

# qkv      [T, 3C]        c_attn output for T new positions (q | k | v, heads contiguous)
# k_cache  [H, d_head, cap]  keys, stored transposed so that the scores of one
#                            query vectorise over key positions
# v_cache  [H, cap, d_head]
# past     positions already in the cache; the new ones go to past..past+T-1
# z        [T, C]          per-head outputs, heads concatenated (input of c_proj)
# scores, pattern [H, T, past+T] or NULL: scaled masked scores, softmax weights
cdef void attention(float* z, const float* qkv, float* k_cache, float* v_cache,
                    Py_ssize_t past, Py_ssize_t T, Py_ssize_t H, Py_ssize_t d_head,
                    Py_ssize_t cap, float* scores, float* pattern,
                    float* scratch, int nthreads) noexcept nogil

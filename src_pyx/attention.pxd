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

# The pieces a fused decode step calls per head (h), for T new positions:
# write their keys and values into the cache ...
cdef void append_kv_head(const float* qkv, float* k_cache, float* v_cache, Py_ssize_t past,
                         Py_ssize_t T, Py_ssize_t h, Py_ssize_t H, Py_ssize_t d_head,
                         Py_ssize_t cap) noexcept nogil
# ... and attend one query q [D] of one head to its first L keys:
# kT = k_cache + h * D * cap, vh = v_cache + h * cap * D; z [D] out;
# s (cap + 64 floats) and zacc (D + 64) scratch; scores/pattern rows of
# width S at offset `at` (or NULL).
cdef void attend_one(float* z, const float* q, const float* kT, const float* vh,
                     Py_ssize_t L, Py_ssize_t d_head, Py_ssize_t cap, float* s, float* zacc,
                     Py_ssize_t S, float* scores, float* pattern, Py_ssize_t at) noexcept nogil

# Causal multi-head self-attention over a key/value cache, and the rotary
# position embedding applied before it.  This is the only module where
# positions mix.

cdef enum:
    KEY_BLOCK = 64  # key positions scored per register-resident strip

# Floats of scratch per thread for a cache of `cap` positions.
cdef Py_ssize_t attention_scratch_size(Py_ssize_t cap, Py_ssize_t d_head) noexcept nogil
# Floats of scratch attend_one needs.
cdef Py_ssize_t attend_one_scratch_size(Py_ssize_t cap, Py_ssize_t d_head) noexcept nogil

# qkv      [T, (H + 2G) D]  q | k | v for T new positions: H query heads, G
#                           key/value heads (G divides H), heads contiguous
# k_cache  [G, d_head, cap] keys, stored transposed so that the scores of one
#                           query vectorise over key positions
# v_cache  [G, cap, d_head]
# past     positions already in the cache; the new ones go to past..past+T-1
# z        [T, H D]         per-head outputs, heads concatenated (input of c_proj)
# scores, pattern [H, T, past+T] or NULL: scaled masked scores, softmax weights
cdef void attention(float* z, const float* qkv, float* k_cache, float* v_cache,
                    Py_ssize_t past, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G,
                    Py_ssize_t d_head, Py_ssize_t cap, float* scores, float* pattern,
                    float* scratch, int nthreads) noexcept nogil

# Rotary embedding of one head vector x [D] in place, by the angles whose
# cosines and sines are cos, sin [D/2] (Hugging Face's rotate-half layout).
cdef void rope_head(float* x, Py_ssize_t D, const float* cos, const float* sin) noexcept nogil
# ... of every query and key head of qkv rows at positions past..past+T-1;
# cos, sin [positions, D/2].
cdef void rope(float* qkv, Py_ssize_t T, Py_ssize_t H, Py_ssize_t G, Py_ssize_t D,
               Py_ssize_t past, const float* cos, const float* sin, int nthreads) noexcept nogil

# The pieces a fused decode step calls per head, for T new positions:
# write key/value head g's keys and values into the cache ...
cdef void append_kv_head(const float* qkv, float* k_cache, float* v_cache, Py_ssize_t past,
                         Py_ssize_t T, Py_ssize_t g, Py_ssize_t H, Py_ssize_t G,
                         Py_ssize_t d_head, Py_ssize_t cap) noexcept nogil
# ... and attend one query q [D] of one head to its first L keys:
# kT = k_cache + g * D * cap, vh = v_cache + g * cap * D; z [D] out;
# scratch: attend_one_scratch_size(cap, D) floats; scores/pattern rows of
# width S at offset `at` (or NULL).
cdef void attend_one(float* z, const float* q, const float* kT, const float* vh,
                     Py_ssize_t L, Py_ssize_t d_head, Py_ssize_t cap, float* scratch,
                     Py_ssize_t S, float* scores, float* pattern, Py_ssize_t at) noexcept nogil

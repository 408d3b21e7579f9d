# Buffer helpers shared by the def wrappers (inline, so no runtime import).
# The arrays have already been validated by cyformer._checks; these only
# turn them into raw pointers for the nogil kernels.

cdef inline const float* cptr(object a):
    # read-only inputs (weights may be read-only views of the checkpoint)
    cdef const float[::1] v
    if a is None or a.size == 0:
        return NULL
    v = a.reshape(-1)
    return &v[0]

cdef inline float* wptr(object a):
    cdef float[::1] v
    if a is None or a.size == 0:
        return NULL
    v = a.reshape(-1)
    return &v[0]

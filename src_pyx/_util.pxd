# Argument checks and raw pointers for the def wrappers (inline: no runtime
# import between kernel modules).  The fast path asks NumPy's C API directly
# (tens of nanoseconds, which matters when decode makes ~100 calls a token);
# when a check fails, cyformer._checks builds the error message.

cimport numpy as cnp


cdef inline object f32(str fn, str name, object a, int ndim, bint writable=False):
    """a must be a C-contiguous, native-endian float32 ndarray with ndim
    dimensions (ndim < 0: any); writable when written to.  Returns a."""
    cdef cnp.ndarray arr
    if cnp.PyArray_Check(a):
        arr = <cnp.ndarray>a
        if (cnp.PyArray_TYPE(arr) == cnp.NPY_FLOAT32 and cnp.PyArray_ISNOTSWAPPED(arr)
                and (ndim < 0 or cnp.PyArray_NDIM(arr) == ndim)
                and cnp.PyArray_IS_C_CONTIGUOUS(arr)
                and (not writable or cnp.PyArray_ISWRITEABLE(arr))):
            return a
    from cyformer import _checks
    return _checks.f32(fn, name, a, None if ndim < 0 else ndim, writable)


cdef inline const float* cptr(object a):
    # read-only input, already checked by f32 (None -> NULL)
    if a is None:
        return NULL
    return <const float*>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef inline float* wptr(object a):
    if a is None:
        return NULL
    return <float*>cnp.PyArray_DATA(<cnp.ndarray>a)

# The OpenMP team helpers of team.h, declared once.

cdef extern from "team.h" nogil:
    int cyf_team_size()
    void cyf_barrier()
    Py_ssize_t cyf_next_item(Py_ssize_t* counter)

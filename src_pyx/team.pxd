# The OpenMP team helpers of team.h, declared once.

cdef extern from "team.h" nogil:
    int cyf_team_size()
    void cyf_barrier()
    # a team's own barrier (team.h: why), zeroed before the parallel region
    ctypedef struct cyf_bar:
        unsigned gen
        int arrived
        int sleepers
    void cyf_bar_wait(cyf_bar* b, int n)
    Py_ssize_t cyf_next_item(Py_ssize_t* counter)

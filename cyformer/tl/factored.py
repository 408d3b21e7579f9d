"""TransformerLens's FactoredMatrix over NumPy arrays or torch tensors.

M = A @ B with A [..., ldim, mdim] and B [..., mdim, rdim], mdim small (a
head's d_head), leading axes batched (``model.OV`` is [L, H, C, C]).  The
spectrum comes from mdim-sized problems: M's nonzero eigenvalues are those
of B @ A, and with A = Ua Sa Va^T, B = Ub Sb Vb^T the singular values of M
are those of (Sa Va^T Ub Sb) [mdim, mdim], as TransformerLens computes them.
The same code serves both kinds: NumPy arrays and torch tensors share
``@``, ``swapaxes``, ``[..., None]`` and a ``linalg`` with ``svd``/``eigvals``.
"""

import numpy as np


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _linalg(x):
    if _is_torch(x):
        import torch
        return torch.linalg
    return np.linalg


def _t(x):
    return x.swapaxes(-1, -2)


def _wide(x):
    """float64 for the decompositions (float32 eigenproblems of a 768 x 768
    circuit lose digits TransformerLens's float32 keeps only by luck)."""
    return x.double() if _is_torch(x) else x.astype(np.float64)


class FactoredMatrix:
    """A @ B kept factored; TransformerLens's names (A, B, AB, BA, T, svd(),
    U, S, V, eigenvalues, norm(), get_corner(), ldim, mdim, rdim)."""

    # let ``ndarray @ FactoredMatrix`` reach __rmatmul__ instead of NumPy
    __array_ufunc__ = None

    def __init__(self, A, B):
        if A.shape[-1] != B.shape[-2]:
            raise ValueError(f"FactoredMatrix: A [..., m, k] and B [..., k, n] must share k, "
                             f"got {tuple(A.shape)} and {tuple(B.shape)}")
        lead = tuple(np.broadcast_shapes(tuple(A.shape[:-2]), tuple(B.shape[:-2])))
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = lead + (self.ldim, self.rdim)
        self.A = A if tuple(A.shape[:-2]) == lead else _broadcast(A, lead + tuple(A.shape[-2:]))
        self.B = B if tuple(B.shape[:-2]) == lead else _broadcast(B, lead + tuple(B.shape[-2:]))

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def pair(self):
        return self.A, self.B

    def __repr__(self):
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"

    @property
    def AB(self):
        """The full matrix [..., ldim, rdim]."""
        return self.A @ self.B

    @property
    def BA(self):
        """[..., mdim, mdim] (ldim = rdim only)."""
        if self.ldim != self.rdim:
            raise ValueError(f"BA: the matrix is {self.ldim}x{self.rdim}, not square")
        return self.B @ self.A

    @property
    def T(self):
        return FactoredMatrix(_t(self.B), _t(self.A))

    def __matmul__(self, other):
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.ndim < 2:  # a vector: the product is a vector
            return self.A @ (self.B @ other)
        return FactoredMatrix(self.A, self.B @ other)

    def __rmatmul__(self, other):
        if other.ndim < 2:
            return (other @ self.A) @ self.B
        return FactoredMatrix(other @ self.A, self.B)

    def __mul__(self, scalar):
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    def __getitem__(self, index):
        """Index the leading (layer, head, ...) axes: ``model.OV[5, 1]`` -> [C, C]."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) > self.ndim - 2:
            raise IndexError(f"FactoredMatrix: index the {self.ndim - 2} leading axes only, got {len(index)} indices")
        return FactoredMatrix(self.A[index], self.B[index])

    def unsqueeze(self, k):
        return FactoredMatrix(self.A[(slice(None),) * k + (None,)], self.B[(slice(None),) * k + (None,)])

    def svd(self):
        """(U [..., ldim, mdim], S [..., mdim], V [..., rdim, mdim]) with
        U @ diag(S) @ V^T = M (float64 arithmetic, returned as float32)."""
        if "_svd" not in self.__dict__:
            la = _linalg(self.A)
            A, B = _wide(self.A), _wide(self.B)
            Ua, Sa, Vha = la.svd(A, full_matrices=False)
            Ub, Sb, Vhb = la.svd(B, full_matrices=False)
            middle = Sa[..., :, None] * (Vha @ Ub) * Sb[..., None, :]
            Um, Sm, Vhm = la.svd(middle, full_matrices=False)
            out = (Ua @ Um, Sm, _t(Vhb) @ _t(Vhm))
            self._svd = tuple(x.float() if _is_torch(x) else x.astype(np.float32) for x in out)
        return self._svd

    U = property(lambda self: self.svd()[0])
    S = property(lambda self: self.svd()[1])
    V = property(lambda self: self.svd()[2])
    Vh = V  # TransformerLens's older name for V

    @property
    def eigenvalues(self):
        """M's nonzero eigenvalues: those of B @ A [..., mdim] (complex)."""
        BA = _wide(self.BA)
        if _is_torch(BA):
            import torch
            return torch.linalg.eigvals(BA).to(torch.complex64)
        return np.linalg.eigvals(BA).astype(np.complex64)

    def norm(self):
        """The Frobenius norm [...]: sqrt of the sum of S^2."""
        return (self.S ** 2).sum(-1) ** 0.5

    def get_corner(self, k=3):
        return (self.A[..., :k, :] @ self.B[..., :, :k])[(0,) * (self.ndim - 2)]

    def collapse_l(self):
        """S V^T [..., mdim, rdim]."""
        return self.S[..., :, None] * _t(self.V)

    def collapse_r(self):
        """U S [..., ldim, mdim]."""
        return self.U * self.S[..., None, :]


def _broadcast(x, shape):
    if _is_torch(x):
        return x.broadcast_to(shape)
    return np.broadcast_to(x, shape)

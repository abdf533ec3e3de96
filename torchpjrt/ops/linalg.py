"""Matrix products and linear algebra.

Products run at HIGHEST precision (float32 must match the CPU, not TF32/bf16 passes) and
accumulate bfloat16/float16 in float32, rounding once as PyTorch's CPU BLAS does.

Factorizations follow LAPACK's conventions, as PyTorch does: `pivots` are 1-based int32
row interchanges and `info` is LAPACK's. PyTorch's CPU kernels for det and slogdet factor
A^T rather than A when A is real and contiguous, and their backward formulas rely on it;
the lowerings do the same (they cannot see strides, so a non-contiguous real A is
treated as contiguous).
"""

import jax.numpy as jnp
from jax import lax
from jax.scipy.linalg import expm

from ..dtypes import LOW_PRECISION
from . import aten, lower

HIGHEST = lax.Precision.HIGHEST


# ---- helpers --------------------------------------------------------------------------------


def _same_dtype(name, *arrays):
    """CPU's BLAS products take one dtype: mixed operands raise, nothing is promoted."""
    dtypes = [jnp.result_type(a) for a in arrays]
    if any(d != dtypes[0] for d in dtypes):
        raise RuntimeError(f"{name}: expected all operands to have the same dtype, but got "
                           + ", ".join(str(d) for d in dtypes))


def _matmul(a, b):
    low = jnp.result_type(a, b) in LOW_PRECISION
    return jnp.matmul(a, b, precision=HIGHEST, preferred_element_type=jnp.float32 if low else None)


def _is_one(v):
    return isinstance(v, int) and v == 1


def _scalars_for(dtype, *scalars):
    """PyTorch converts Scalars to an integer result type (truncating) before using them."""
    if jnp.issubdtype(dtype, jnp.integer):
        return tuple(s if isinstance(s, int) else jnp.asarray(s).astype(dtype) for s in scalars)
    return scalars


def _scaled_sum(self, product, beta, alpha):
    """beta * self + alpha * product; self is ignored (NaNs included) when beta == 0."""
    dtype = jnp.result_type(self, product)
    if dtype == jnp.bool_:
        out = jnp.logical_and(product, alpha)
        return out if beta is False else jnp.logical_or(jnp.logical_and(self, beta), out)
    beta, alpha = _scalars_for(dtype, beta, alpha)
    if not _is_one(alpha):
        product = alpha * product
    if product.dtype == jnp.float32 and jnp.result_type(self) in LOW_PRECISION:
        self = self.astype(jnp.float32)  # one rounding at the end, as the CPU's gemm
    if _is_one(beta):
        return self + product
    return jnp.where(beta == 0, jnp.zeros_like(self), beta * self) + product


def _mH(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


def _is_complex(x):
    return jnp.issubdtype(x.dtype, jnp.complexfloating)


def _broadcast_batch(a, b, a_core=2, b_core=2):
    batch = jnp.broadcast_shapes(a.shape[: a.ndim - a_core], b.shape[: b.ndim - b_core])
    return (jnp.broadcast_to(a, batch + a.shape[a.ndim - a_core:]),
            jnp.broadcast_to(b, batch + b.shape[b.ndim - b_core:]))


def _tri_solve(a, b, *, lower, left=True, adjoint=False, transpose=False, unit=False):
    """Solves op(a) x = b (left) or x op(a) = b, a triangular, batch dims broadcast."""
    a, b = _broadcast_batch(a, b)
    dtype = jnp.result_type(a, b)
    return lax.linalg.triangular_solve(
        a.astype(dtype), b.astype(dtype), left_side=left, lower=lower,
        transpose_a=adjoint or transpose, conjugate_a=adjoint, unit_diagonal=unit)


def _permute_rows(b, perm):
    b, perm = _broadcast_batch(b, perm, 2, 1)
    return jnp.take_along_axis(b, perm[..., :, None], axis=-2)


def _lu(a):
    """(LU, 1-based int32 pivots, permutation with a[perm] = L @ U)."""
    lu, piv, perm = lax.linalg.lu(a)
    return lu, piv.astype(jnp.int32) + 1, perm


def _perm_from_pivots(pivots, m):
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _lu_solve(lu, perm, b, left=True, adjoint=False):
    """Solves A x = b (or A^H x = b) for A = P L U given as jax's (lu, perm)."""
    if not left:  # x A = b  <=>  A^H x^H = b^H
        return _mH(_lu_solve(lu, perm, _mH(b), True, not adjoint))
    if not adjoint:
        y = _tri_solve(lu, _permute_rows(b, perm), lower=True, unit=True)
        return _tri_solve(lu, y, lower=False)
    y = _tri_solve(lu, b, lower=False, adjoint=True)
    y = _tri_solve(lu, y, lower=True, unit=True, adjoint=True)
    return _permute_rows(y, jnp.argsort(perm, axis=-1))


def _lu_info(lu):
    """LAPACK getrf's info: the 1-based index of the first exactly zero pivot, else 0."""
    zero = jnp.diagonal(lu, axis1=-2, axis2=-1) == 0
    if zero.shape[-1] == 0:
        return jnp.zeros(zero.shape[:-1], jnp.int32)
    return jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(jnp.int32)


def _pivot_sign(pivots):
    n = pivots.shape[-1]
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=pivots.dtype), axis=-1)
    return jnp.where(swaps % 2 == 1, -1, 1)


def _factor_for_det(A):
    # PyTorch factors A^T (same determinant) when A is real: see the module docstring
    return _lu(A if _is_complex(A) else jnp.swapaxes(A, -1, -2))


def _empty(dtype):
    return jnp.zeros((0,), dtype)


# ---- products -------------------------------------------------------------------------------


@lower(aten.mm.default)
def mm(self, mat2):
    _same_dtype("mm", self, mat2)
    return _matmul(self, mat2)


@lower(aten.bmm.default)
def bmm(self, mat2):
    _same_dtype("bmm", self, mat2)
    return _matmul(self, mat2)


@lower(aten.mv.default)
def mv(self, vec):
    _same_dtype("mv", self, vec)
    return _matmul(self, vec)


@lower(aten.dot.default)
def dot(self, tensor):
    _same_dtype("dot", self, tensor)
    return _matmul(self, tensor)


@lower(aten.vdot.default)
def vdot(self, other):
    return _matmul(jnp.conj(self), other)


@lower(aten.addmm.default)
def addmm(self, mat1, mat2, beta=1, alpha=1):
    _same_dtype("addmm", self, mat1, mat2)
    return _scaled_sum(self, _matmul(mat1, mat2), beta, alpha)


@lower(aten.baddbmm.default)
def baddbmm(self, batch1, batch2, beta=1, alpha=1):
    _same_dtype("baddbmm", self, batch1, batch2)
    return _scaled_sum(self, _matmul(batch1, batch2), beta, alpha)


@lower(aten.addbmm.default)
def addbmm(self, batch1, batch2, beta=1, alpha=1):
    if jnp.result_type(batch1, batch2) in LOW_PRECISION and batch1.shape[0] > 0:
        return _addbmm_rounded(self, batch1, batch2, beta, alpha)
    product = jnp.einsum("bij,bjk->ik", batch1, batch2, precision=HIGHEST)
    return _scaled_sum(self, product, beta, alpha)


def _addbmm_rounded(self, batch1, batch2, beta, alpha):
    """PyTorch's CPU kernel adds one addmm per batch, rounding each partial sum to the
    low-precision dtype: do the same so bfloat16/float16 results match."""
    dtype = jnp.result_type(self, batch1, batch2)
    first = _scaled_sum(self, _matmul(batch1[0], batch2[0]), beta, alpha).astype(dtype)

    def step(acc, mats):
        return _scaled_sum(acc, _matmul(*mats), 1, alpha).astype(dtype), None

    return lax.scan(step, first, (batch1[1:], batch2[1:]))[0]


@lower(aten.addmv.default)
def addmv(self, mat, vec, beta=1, alpha=1):
    _same_dtype("addmv", self, mat, vec)
    return _scaled_sum(self, _matmul(mat, vec), beta, alpha)


@lower(aten.addr.default)
def addr(self, vec1, vec2, beta=1, alpha=1):
    if jnp.result_type(vec1, vec2) == jnp.bool_:
        return _scaled_sum(self, jnp.logical_and(vec1[:, None], vec2[None, :]), beta, alpha)
    # PyTorch's CPU kernel computes beta * self + (alpha * vec1) * vec2 elementwise
    beta, alpha = _scalars_for(jnp.result_type(self, vec1, vec2), beta, alpha)
    scaled = vec1 if _is_one(alpha) else alpha * vec1
    return _scaled_sum(self, scaled[:, None] * vec2[None, :], beta, 1)


# ---- structure ------------------------------------------------------------------------------


@lower(aten.tril.default)
def tril(self, diagonal=0):
    return jnp.tril(self, diagonal)


@lower(aten.triu.default)
def triu(self, diagonal=0):
    return jnp.triu(self, diagonal)


@lower(aten.trace.default)
def trace(self):
    if self.dtype == jnp.bool_:
        raise NotImplementedError('"trace" not implemented for \'Bool\'')  # as the CPU kernel
    x = self
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.int64)  # PyTorch sums integer traces in int64
    elif x.dtype in LOW_PRECISION:
        x = x.astype(jnp.float32)
    return jnp.trace(x)


@lower(aten.diag_embed.default)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    m = self.shape[-1]
    n = m + abs(offset)
    rows, cols = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    on_diag = cols - rows == offset
    if m == 0:
        out = jnp.zeros(self.shape[:-1] + (n, n), self.dtype)
    else:
        # entry (r, c) of the diagonal is self[..., min(r, c)]
        pos = jnp.clip(jnp.minimum(rows, cols), 0, m - 1)
        out = jnp.where(on_diag, jnp.take(self, pos, axis=-1), jnp.zeros((), self.dtype))
    ndim = out.ndim
    return jnp.moveaxis(out, (-2, -1), (dim1 % ndim, dim2 % ndim))


@lower(aten.linalg_cross.default)
def linalg_cross(self, other, dim=-1):
    a, b = jnp.broadcast_arrays(self, other)
    return jnp.cross(a, b, axis=dim % a.ndim)


# ---- determinants and inverses --------------------------------------------------------------


@lower(aten._linalg_det.default)
def linalg_det(A):
    lu, pivots, _ = _factor_for_det(A)
    det = _pivot_sign(pivots) * jnp.prod(jnp.diagonal(lu, axis1=-2, axis2=-1), axis=-1)
    return det, lu, pivots


@lower(aten._linalg_slogdet.default)
def linalg_slogdet(A):
    lu, pivots, _ = _factor_for_det(A)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    sign = _pivot_sign(pivots) * jnp.prod(jnp.sign(diag), axis=-1)
    logabsdet = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign, logabsdet, lu, pivots


@lower(aten.linalg_inv_ex.default)
def linalg_inv_ex(A, check_errors=False):
    lu, _, perm = _lu(A)
    eye = jnp.broadcast_to(jnp.eye(A.shape[-1], dtype=A.dtype), A.shape)
    return _lu_solve(lu, perm, eye), _lu_info(lu)


# ---- solvers --------------------------------------------------------------------------------


def _is_vector_rhs(A, B):
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lower(aten._linalg_solve_ex.default)
def linalg_solve_ex(A, B, left=True, check_errors=False):
    lu, pivots, perm = _lu(A)
    vector = _is_vector_rhs(A, B)
    rhs = B[..., None] if vector else B
    result = _lu_solve(lu, perm, rhs, left)
    return (result[..., 0] if vector else result), lu, pivots, _lu_info(lu)


def _require_pivoting(pivot):
    if not pivot:  # PyTorch's CPU kernels refuse it too (and jax has no unpivoted LU)
        raise RuntimeError("linalg.lu_factor: LU without pivoting is not implemented on the CPU")


@lower(aten.linalg_lu_factor_ex.default)
def linalg_lu_factor_ex(A, pivot=True, check_errors=False):
    _require_pivoting(pivot)
    lu, pivots, _ = _lu(A)
    return lu, pivots, _lu_info(lu)


@lower(aten.linalg_lu_solve.default)
def linalg_lu_solve(LU, pivots, B, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    return _lu_solve(LU, perm, B, left, adjoint)


def _unpack_lu(lu):
    m, n = lu.shape[-2:]
    k = min(m, n)
    L = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    U = jnp.triu(lu[..., :k, :])
    return L, U


def _perm_matrix(perm, dtype):
    # A = P L U with A[perm] = L U: P[perm[i], i] = 1
    m = perm.shape[-1]
    return jnp.swapaxes(jnp.eye(m, dtype=dtype)[perm], -1, -2)


@lower(aten.linalg_lu.default)
def linalg_lu(A, pivot=True):
    _require_pivoting(pivot)
    lu, _, perm = _lu(A)
    L, U = _unpack_lu(lu)
    return _perm_matrix(perm, A.dtype), L, U


@lower(aten.lu_unpack.default)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m = LU_data.shape[-2]
    if unpack_pivots:
        P = _perm_matrix(_perm_from_pivots(LU_pivots, m), LU_data.dtype)
    else:
        P = _empty(LU_data.dtype)
    L, U = _unpack_lu(LU_data) if unpack_data else (_empty(LU_data.dtype), _empty(LU_data.dtype))
    return P, L, U


@lower(aten.triangular_solve.default)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    A_b, _ = _broadcast_batch(A, self)
    X = _tri_solve(A, self, lower=not upper, transpose=transpose, unit=unitriangular)
    return X, A_b


@lower(aten.linalg_solve_triangular.default)
def linalg_solve_triangular(self, B, upper, left=True, unitriangular=False):
    return _tri_solve(self, B, lower=not upper, left=left, unit=unitriangular)


# ---- least squares --------------------------------------------------------------------------


def _real_dtype(x):
    return jnp.real(jnp.zeros((), x.dtype)).dtype


@lower(aten.linalg_lstsq.default, dynamic_shape=True)
def linalg_lstsq(self, b, rcond=None, driver=None):
    """Minimum-norm least squares by SVD (what gelsd/gelss compute; gelsy and gels agree
    on the inputs they accept). No meta kernel exists and, for the SVD drivers, residuals
    exist only when every matrix has full rank: this runs eagerly on concrete arrays and
    builds the outputs PyTorch's CPU kernel gives for `driver`."""
    driver = driver or "gelsy"
    m, n = self.shape[-2:]
    vector = _is_vector_rhs(self, b)
    A, B = _broadcast_batch(self, b[..., None] if vector else b)
    real = _real_dtype(A)
    U, S, Vh = jnp.linalg.svd(A, full_matrices=False)
    if rcond is None:
        rcond = jnp.finfo(real).eps * max(m, n)
    keep = S > rcond * jnp.max(S, axis=-1, keepdims=True, initial=0)
    inv_s = jnp.where(keep, 1 / jnp.where(keep, S, 1), 0).astype(A.dtype)
    X = _matmul(_mH(Vh), inv_s[..., :, None] * _matmul(_mH(U), B))
    rank = jnp.sum(keep, axis=-1, dtype=jnp.int64)
    full_rank = driver == "gels" or bool(jnp.all(rank == n))
    if m > n and driver != "gelsy" and full_rank:
        residuals = jnp.sum(jnp.abs(_matmul(A, X) - B) ** 2, axis=-2).astype(real)
    else:
        residuals = _empty(real)
    return (X[..., 0] if vector else X, residuals,
            rank if driver != "gels" else _empty(jnp.int64),
            S if driver in ("gelsd", "gelss") else _empty(real))


# ---- Cholesky -------------------------------------------------------------------------------


def _cholesky_lower(A, upper):
    """(L, the Hermitian matrix it factors), reading only the triangle LAPACK reads."""
    if upper:
        A = _mH(A)  # its lower triangle is the conjugate of A's upper one
    L = lax.linalg.cholesky(A, symmetrize_input=False)
    return L, A


def _cholesky_info(A, failed):
    """potrf's info for factorizations that failed: the order of the first leading minor
    that is not positive definite. An outer-product Cholesky finds it; it runs (n
    sequential steps) only when some matrix of the batch failed."""
    n = A.shape[-1]
    if n == 0:
        return jnp.zeros(A.shape[:-2], jnp.int32)
    full = jnp.tril(A) + _mH(jnp.tril(A, -1))
    idx = jnp.arange(n)

    def step(k, state):
        a, info = state
        pivot = jnp.real(a[..., k, k])
        info = jnp.where((info == 0) & ~(pivot > 0), k + 1, info)
        col = a[..., :, k] / jnp.sqrt(jnp.where(pivot > 0, pivot, 1))[..., None]
        col = jnp.where(idx > k, col, 0)
        return a - col[..., :, None] * jnp.conj(col[..., None, :]), info

    def search(_):
        zeros = jnp.zeros(A.shape[:-2], jnp.int32)
        return lax.fori_loop(0, n, step, (full, zeros))[1]

    info = lax.cond(jnp.any(failed), search, lambda _: jnp.zeros(A.shape[:-2], jnp.int32), None)
    return jnp.where(failed, info, 0)


@lower(aten.linalg_cholesky_ex.default)
def linalg_cholesky_ex(self, upper=False, check_errors=False):
    L, A = _cholesky_lower(self, upper)
    failed = ~jnp.all(jnp.isfinite(L), axis=(-2, -1))
    return (_mH(L) if upper else L), _cholesky_info(A, failed)


@lower(aten.cholesky.default)
def cholesky(self, upper=False):
    L, _ = _cholesky_lower(self, upper)
    return _mH(L) if upper else L


def _cholesky_solve(B, F, upper):
    """Solves A X = B for A = L L^H (F = L) or A = U^H U (F = U)."""
    if upper:
        y = _tri_solve(F, B, lower=False, adjoint=True)
        return _tri_solve(F, y, lower=False)
    y = _tri_solve(F, B, lower=True)
    return _tri_solve(F, y, lower=True, adjoint=True)


@lower(aten.cholesky_solve.default)
def cholesky_solve(self, input2, upper=False):
    return _cholesky_solve(self, input2, upper)


@lower(aten.cholesky_inverse.default)
def cholesky_inverse(self, upper=False):
    eye = jnp.broadcast_to(jnp.eye(self.shape[-1], dtype=self.dtype), self.shape)
    return _cholesky_solve(eye, self, upper)


# ---- QR, SVD, eigendecompositions -----------------------------------------------------------


@lower(aten.linalg_qr.default)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        return _empty(A.dtype), jnp.linalg.qr(A, mode="r")
    return jnp.linalg.qr(A, mode=mode)


@lower(aten.geqrf.default)
def geqrf(self):
    h, tau = jnp.linalg.qr(self, mode="raw")  # LAPACK's geqrf output, transposed
    return jnp.swapaxes(h, -1, -2), tau


@lower(aten.linalg_householder_product.default)
def linalg_householder_product(input, tau):
    return lax.linalg.householder_product(input, tau)


@lower(aten.ormqr.default)
def ormqr(self, input2, input3, left=True, transpose=False):
    return lax.linalg.ormqr(self, input2, input3, left=left, transpose=transpose)


@lower(aten._linalg_svd.default)
def linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        return _empty(A.dtype), jnp.linalg.svd(A, compute_uv=False), _empty(A.dtype)
    return jnp.linalg.svd(A, full_matrices=full_matrices)


@lower(aten._linalg_eigh.default)
def linalg_eigh(A, UPLO="L", compute_v=True):
    if UPLO == "U":
        A = _mH(A)  # LAPACK reads the upper triangle: its conjugate transpose's lower one
    vectors, values = lax.linalg.eigh(A, lower=True, symmetrize_input=False)
    return values, (vectors if compute_v else _empty(A.dtype))


@lower(aten.linalg_eig.default)
def linalg_eig(self):
    values, vectors = lax.linalg.eig(self, compute_left_eigenvectors=False)
    return values, vectors


@lower(aten._linalg_eigvals.default)
def linalg_eigvals(self):
    values, = lax.linalg.eig(self, compute_left_eigenvectors=False,
                             compute_right_eigenvectors=False)
    return values


@lower(aten.linalg_matrix_exp.default)
def linalg_matrix_exp(self):
    return expm(self)

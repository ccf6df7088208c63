"""Multinomial (softmax) regression with the Böhning bound (DESIGN.md §2).

``l = eta_y - lse(eta)``. With ``A_K = (I - 11^T / K) / 2`` (which dominates the
Hessian of ``lse`` everywhere), ``g = softmax(psi)`` and ``d = eta - psi``,

    lse(eta) <= lse(psi) + d^T g + d^T A_K d / 2,

so ``beta = eta_y - lse(psi) - d^T g - d^T A_K d / 2 - eps`` is a lower bound on
``l``, tight at ``eta = psi`` (and along ``eta = psi + c 1``).

Numerics: ``l`` and ``beta`` are both invariant under ``eta -> eta + c 1``, so
they are computed from the differences ``u = eta - eta_y`` and
``w = psi - psi_y`` (``e = d - d_y = u - w``):

    l    = -lse(u)
    beta = -lse(w) - g^T e - sum_k (e_k - mean(e))^2 / 4 - eps.

This keeps ``delta = l - beta >= 0`` after rounding even for huge logits along
the flat direction, where a naive evaluation loses ``~1e-16 * |eta|``.
"""

from __future__ import annotations

import numbers

import numpy as np

from flymc_dist._numerics import BOUND_EPS, logsumexp, weighted_gram
from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.priors import Prior, PriorMixin

__all__ = ["SoftmaxRegression"]


def _first_bad(y: np.ndarray, bad: np.ndarray, what: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"y[{i}] = {y[i].item()!r} is not {what}")


def _relative_to_label(a: np.ndarray, yi: np.ndarray) -> np.ndarray:
    """``a - a[..., n, y_n]`` for ``a`` of shape (..., n, K)."""
    ar = np.arange(yi.shape[0])
    return a - a[..., ar, yi][..., None]


class SoftmaxRegression(PriorMixin, Model):
    """K-class softmax regression, ``y in {0, ..., K-1}``, ``theta`` of shape (K, D).

    Parameters
    ----------
    n_classes
        K >= 2.
    prior
        ``"normal"``, ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    """

    name = "softmax"
    task = "multiclass"

    def __init__(self, n_classes: int, prior: str = "normal", prior_scale: float = 1.0) -> None:
        if isinstance(n_classes, bool) or not isinstance(n_classes, numbers.Integral):
            raise ValueError(f"n_classes must be an integer >= 2, got {n_classes!r}")
        if n_classes < 2:
            raise ValueError(f"n_classes must be >= 2, got {n_classes!r}")
        self.n_classes = int(n_classes)
        self._prior = Prior(prior, prior_scale)
        K = self.n_classes
        self._A_K = 0.5 * (np.eye(K) - np.full((K, K), 1.0 / K))

    # ----- shapes / validation ------------------------------------------------
    @property
    def n_outputs(self) -> int:
        """E = K."""
        return self.n_classes

    @property
    def xi_shape(self) -> tuple[int, ...]:
        """The tight point is a vector of K logits: ``(K,)``."""
        return (self.n_classes,)

    def validate_targets(self, y: np.ndarray) -> None:
        """Raise ``ValueError`` naming the first row that is not a label in ``0..K-1``."""
        y = np.asarray(y)
        if y.ndim != 1:
            raise ValueError(f"y must be one-dimensional, got shape {y.shape}")
        if y.dtype == bool:
            return
        K = self.n_classes
        what = f"a class label in 0..{K - 1} (n_classes = {K})"
        if np.issubdtype(y.dtype, np.integer):
            _first_bad(y, (y < 0) | (y >= K), what)
        elif np.issubdtype(y.dtype, np.floating):
            ok = np.isfinite(y)
            ok[ok] = (y[ok] == np.floor(y[ok])) & (y[ok] >= 0) & (y[ok] < K)
            _first_bad(y, ~ok, what)
        else:
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")

    @staticmethod
    def _labels(y: np.ndarray) -> np.ndarray:
        return np.asarray(y).astype(np.intp, copy=False)

    # ----- likelihood ---------------------------------------------------------
    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``eta_y - lse(eta)``: (B, n, K) -> (B, n)."""
        u = _relative_to_label(np.asarray(eta, dtype=np.float64), self._labels(y))
        out = logsumexp(u)
        np.negative(out, out=out)
        return out

    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(l, e_y - softmax(eta))``."""
        yi = self._labels(y)
        u = _relative_to_label(np.asarray(eta, dtype=np.float64), yi)
        lse = logsumexp(u, keepdims=True)
        g = u - lse
        np.exp(g, out=g)
        np.negative(g, out=g)
        g[..., np.arange(yi.shape[0]), yi] += 1.0
        return -lse[..., 0], g

    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``-(diag(p) - p p^T)`` with ``p = softmax(eta)``: (n, K) -> (n, K, K)."""
        e = np.asarray(eta, dtype=np.float64)
        p = e - logsumexp(e, keepdims=True)
        np.exp(p, out=p)
        H = p[..., :, None] * p[..., None, :]
        idx = np.arange(self.n_classes)
        H[..., idx, idx] -= p
        return H

    # ----- bound --------------------------------------------------------------
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """``psi_n = 0``: shape (n, K)."""
        return np.zeros((np.shape(y)[0], self.n_classes))

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``psi_n = eta_hat_n`` (tight at the estimate): (n, K) -> (n, K)."""
        return np.array(eta_hat, dtype=np.float64, copy=True)

    def exact_xi(self, y: np.ndarray) -> np.ndarray:
        """``psi_n = −1000 e_{y_n}`` (the label's logit 1,000 below the others'): the bound
        is about ``1000² (K − 1) / (4K) ≥ 125,000`` nats below the log-likelihood where the
        logits differ by much less than 1,000."""
        yi = self._labels(y)
        psi = np.zeros((yi.shape[0], self.n_classes))
        psi[np.arange(yi.shape[0]), yi] = -1000.0
        return psi

    def _psi_terms(
        self, psi: np.ndarray, yi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``w = psi - psi_y``, ``lse(w)``, ``g = softmax(psi)``, ``eps_n``."""
        w = _relative_to_label(np.asarray(psi, dtype=np.float64), yi)
        lse_w = logsumexp(w)
        g = w - lse_w[:, None]
        np.exp(g, out=g)
        eps = BOUND_EPS * (1.0 + lse_w)
        return w, lse_w, g, eps

    def _bound(
        self, eta: np.ndarray, y: np.ndarray, psi: np.ndarray, want_grad: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        yi = self._labels(y)
        w, lse_w, g, eps = self._psi_terms(psi, yi)
        e = _relative_to_label(np.asarray(eta, dtype=np.float64), yi)
        e -= w
        beta = np.einsum("...nk,nk->...n", e, g)
        e -= e.mean(axis=-1, keepdims=True)
        beta += 0.25 * np.einsum("...nk,...nk->...n", e, e)
        beta += lse_w + eps
        np.negative(beta, out=beta)
        if not want_grad:
            return beta, None
        # d beta / d eta = e_y - g - A_K (eta - psi) = e_y - g - (e - mean(e)) / 2
        e *= -0.5
        e -= g
        e[..., np.arange(yi.shape[0]), yi] += 1.0
        return beta, e

    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """Böhning lower bound ``beta``: (B, n, K) -> (B, n)."""
        return self._bound(eta, y, xi, want_grad=False)[0]

    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(beta, dbeta/deta)`` with ``dbeta/deta = e_y - g - A_K (eta - psi)``."""
        beta, grad = self._bound(eta, y, xi, want_grad=True)
        return beta, grad

    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """Collapsed bound in the row-major flattened ``theta`` (K, D).

        ``beta_n = -eta^T A_K eta / 2 + v_n^T eta + c_n`` with ``eta = theta x_n``,
        ``v_n = e_{y_n} - g_n + A_K psi_n`` and
        ``c_n = -lse(psi_n) + psi_n^T g_n - psi_n^T A_K psi_n / 2 - eps_n``; so
        ``A = -kron(A_K, sum x x^T) / 2``, ``b = vec(V^T X)``, ``c = sum c_n``.
        """
        X = np.asarray(X)
        K = self.n_classes
        n = X.shape[0] if X.ndim == 2 else -1
        if X.ndim != 2 or np.shape(y) != (n,) or np.shape(xi) != (n, K):
            raise ValueError(
                f"suffstats needs X (n, D), y (n,), xi (n, {K}); got {X.shape}, "
                f"{np.shape(y)}, {np.shape(xi)}"
            )
        yi = self._labels(y)
        psi = np.asarray(xi, dtype=np.float64)
        w, lse_w, g, eps = self._psi_terms(psi, yi)
        pc = psi - psi.mean(axis=1, keepdims=True)  # (I - 11^T/K) psi = 2 A_K psi
        # -lse(psi) + psi^T g = sum_k g_k log g_k, with log g = w - lse(w)
        w -= lse_w[:, None]
        c = np.einsum("nk,nk->", g, w) - 0.25 * np.einsum("nk,nk->", pc, pc) - eps.sum()
        V = 0.5 * pc
        V -= g
        V[np.arange(n), yi] += 1.0
        b = (V.T @ X).ravel()
        A = -0.5 * np.kron(self._A_K, weighted_gram(X))
        return BoundStats(A, np.asarray(b, dtype=np.float64), float(c))

    # ----- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"name": "softmax", "n_classes": K, "prior": ..., "prior_scale": ...}``."""
        return {"name": self.name, "n_classes": self.n_classes, **self._prior.to_dict()}

    def __repr__(self) -> str:
        return (
            f"SoftmaxRegression(n_classes={self.n_classes}, prior={self.prior!r}, "
            f"prior_scale={self.prior_scale!r})"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))

"""The model made from a family (:mod:`flymc_dist.models.families`): ``GLM(family, …)``
derives the bound, its collapsed statistics, the compiled ``log L̃`` and their gradients
from the family, once, and checks a user family's bound where tight points are set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.families import CustomFamily, Family, resolve_family
from flymc_dist.models.priors import Prior, PriorMixin

__all__ = ["GLM"]

#: how far a custom family's bound is checked beyond the data's η range, in units of
#: that range (at least 1 in η either side)
CHECK_WIDEN = 0.5
#: points per row in a custom family's check
CHECK_POINTS = 65


class GLM(PriorMixin, Model):
    """A generalised linear model ``y_n ~ family(η_n)``, ``η_n = θᵀx_n``, with the
    family's curvature bound as FlyMC's bound (MAP-tuned: tight at ``η̂_n = θ̂ᵀx_n``).

    Parameters
    ----------
    family
        ``"binomial"``, ``"negative_binomial"``, ``"gaussian"``, ``"logistic"``,
        ``"student_t"``, ``"softmax"`` (``"poisson"`` is refused, saying why), or a :class:`Family`
        object (e.g. a :class:`CustomFamily`).
    link
        The family's link (default: ``"logit"`` for binomial, ``"log"``, ``"identity"``).
    prior
        ``"normal"`` (default), ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    **family_params
        The family's parameters: ``trials`` (binomial), ``dispersion``
        (negative binomial), ``scale`` (Gaussian), ``xi_untuned`` (logistic), ``nu`` and
        ``scale`` (Student-t), ``n_classes`` and ``bound`` (softmax).
    """

    name = "glm"

    def __init__(
        self,
        family: str | Family,
        link: str | None = None,
        prior: str = "normal",
        prior_scale: float = 1.0,
        **family_params: Any,
    ) -> None:
        self.family = resolve_family(family, link, family_params)
        self._prior = Prior(prior, prior_scale)

    @property
    def task(self) -> str:  # type: ignore[override]
        """The family's task."""
        return self.family.task

    @property
    def log_concave(self) -> bool:  # type: ignore[override]
        """Whether the family's ``f`` is concave in ``η``."""
        return self.family.log_concave

    @property
    def bound_tight(self) -> bool:  # type: ignore[override]
        """Whether the family's bound equals ``f`` at its tight points."""
        return self.family.tight

    @property
    def n_outputs(self) -> int:
        """E, the family's linear predictors per row (1, or K classes)."""
        return self.family.n_outputs

    @property
    def xi_shape(self) -> tuple[int, ...]:
        """One tight point per datum (``()``), or K of them (``(K,)``)."""
        E = self.family.n_outputs
        return () if E == 1 else (E,)

    def _eta(self, eta: np.ndarray) -> np.ndarray:
        """``η`` as the family takes it: (..., n) for one output, (..., n, K) for K."""
        e = np.asarray(eta, dtype=np.float64)
        return e[..., 0] if self.family.n_outputs == 1 else e

    def _plus_base(self, v: np.ndarray, yv: np.ndarray) -> np.ndarray:
        """``v`` (a fresh array from the family) plus the family's ``base(y)``, if any."""
        base = self.family.base(yv)
        if base is not None:
            v += base
        return v

    def _per_output(self, d: np.ndarray) -> np.ndarray:
        """A family's derivative in ``η`` with the outputs' axis: (..., n, E)."""
        return d[..., None] if self.family.n_outputs == 1 else d

    def validate_targets(self, y: np.ndarray) -> None:
        """The family's check of ``y``."""
        self.family.validate_targets(y)

    # ----- likelihood ---------------------------------------------------------
    def loglik(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f(η; y)``: (B, n, E) -> (B, n)."""
        yv = np.asarray(y, dtype=np.float64)
        return self._plus_base(self.family.value(self._eta(eta), yv), yv)

    def loglik_grad(self, eta: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(f, f')``: shapes (B, n) and (B, n, E)."""
        yv = np.asarray(y, dtype=np.float64)
        f, g = self.family.core(self._eta(eta), yv)
        return self._plus_base(f, yv), self._per_output(g)

    def loglik_hess(self, eta: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``f''``: (n, E) -> (n, E, E)."""
        h = self.family.core_hess(self._eta(eta), np.asarray(y, dtype=np.float64))
        return h[:, None, None] if self.family.n_outputs == 1 else h

    # ----- bound --------------------------------------------------------------
    def untuned_xi(self, y: np.ndarray) -> np.ndarray:
        """The family's untuned tight points: shape (n,) + xi_shape."""
        xi = self.family.untuned_xi(y)
        if self.family.checked:
            self.check_bound(y, xi)
        return xi

    def tuned_xi(self, eta_hat: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The family's tight points at ``η̂`` (by default ``ξ_n = η̂_n``): (n, E) ->
        (n,) + xi_shape."""
        xi = self.family.tuned_xi(self._eta(eta_hat), y)
        if self.family.checked:
            self.check_bound(y, xi)
        return xi

    def exact_xi(self, y: np.ndarray) -> np.ndarray | None:
        """The family's far tight points, or None."""
        return self.family.exact_xi(y)

    def check_bound(self, y: np.ndarray, xi: np.ndarray) -> None:
        """Check ``B_ξ(η) ≤ f(η)`` for every row on :data:`CHECK_POINTS` values of ``η``
        spanning ``[min ξ − w, max ξ + w]``, ``w = max(1, CHECK_WIDEN · (max ξ − min ξ))``.

        Raises
        ------
        ValueError
            Naming the first row, ``η`` and ``y`` where the bound exceeds ``f`` by more
            than rounding.
        """
        y = np.asarray(y, dtype=np.float64)
        xi = np.asarray(xi, dtype=np.float64)
        if y.size == 0:
            return
        lo, hi = float(xi.min()), float(xi.max())
        w = max(1.0, CHECK_WIDEN * (hi - lo))
        grid = np.linspace(lo - w, hi + w, CHECK_POINTS)
        for s in range(0, y.size, 4096):
            yb, xb = y[s : s + 4096], xi[s : s + 4096]
            coef = tuple(q[:, None] for q in self.family.bound_coefficients(yb, xb))
            eta = np.concatenate([grid[None, :].repeat(yb.size, 0), xb[:, None]], axis=1)
            f = self.family.value(eta, yb[:, None])
            beta = self.family.bound(eta, yb[:, None], coef, grad=False)[0]
            tol = 1e-9 * (1.0 + np.abs(f) + np.abs(beta))
            bad = ~(beta - f <= tol)  # NaN is a violation too
            if bad.any():
                i, j = np.unravel_index(int(np.argmax(bad)), bad.shape)
                raise ValueError(
                    f"family {self.family.name!r}: its bound exceeds f at row {s + i} "
                    f"(eta = {eta[i, j]!r}, y = {yb[i]!r}, tight at {xb[i]!r}): "
                    f"B - f = {beta[i, j] - f[i, j]!r}; the curvature {self.family.name!r} "
                    f"declares is too small (or f' is not the derivative of f)"
                )

    def logbound(self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray) -> np.ndarray:
        """``β = β_core + base(y)``, the family's bound tight at ``xi``: (B, n, E) -> (B, n)."""
        yv = np.asarray(y, dtype=np.float64)
        coef = self.family.bound_coefficients(yv, xi)
        beta = self.family.bound(self._eta(eta), yv, coef, grad=False)[0]
        return self._plus_base(beta, yv)

    def logbound_grad(
        self, eta: np.ndarray, y: np.ndarray, xi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(β, dβ/dη)``: shapes (B, n) and (B, n, E)."""
        yv = np.asarray(y, dtype=np.float64)
        coef = self.family.bound_coefficients(yv, xi)
        beta, g = self.family.bound(self._eta(eta), yv, coef)
        return self._plus_base(beta, yv), self._per_output(g)

    def row_constants(self, y: np.ndarray, xi: np.ndarray) -> np.ndarray | None:
        """The family's row constants for its compiled kind, or None (no compiled form)."""
        if self.family.compiled() is None:
            return None
        yv = np.asarray(y, dtype=np.float64)
        return self.family.row_constants(yv, self.family.bound_coefficients(yv, xi))

    def compiled_bright(self) -> tuple[str, np.ndarray] | None:
        """The family's ``(kind, parameters)``, or None (e.g. a custom family)."""
        return self.family.compiled()

    def suffstats(self, X: np.ndarray, y: np.ndarray, xi: np.ndarray) -> BoundStats:
        """The family's collapsed bound (:meth:`Family.collapse`), plus ``Σ base(y)``."""
        X = np.asarray(X)
        n = X.shape[0] if X.ndim == 2 else -1
        if X.ndim != 2 or np.shape(y) != (n,) or np.shape(xi) != (n, *self.xi_shape):
            want = "(n,)" if self.n_outputs == 1 else f"(n, {self.n_outputs})"
            raise ValueError(
                f"suffstats needs X (n, D), y (n,), xi {want}; got {X.shape}, "
                f"{np.shape(y)}, {np.shape(xi)}"
            )
        yv = np.asarray(y, dtype=np.float64)
        st = self.family.collapse(X, yv, self.family.bound_coefficients(yv, xi))
        base = self.family.base(yv)
        return st if base is None else BoundStats(st.A, st.b, float(st.c + base.sum()))

    # ----- serialisation ------------------------------------------------------
    def to_dict(self) -> dict:
        """``{"name": "glm", "family": ..., "link": ..., <parameters>, "prior": ...}``."""
        return {"name": self.name, **self.family.to_dict(), **self._prior.to_dict()}

    def __repr__(self) -> str:
        d = self.family.to_dict()
        args = ", ".join(f"{k}={v!r}" for k, v in d.items())
        return f"GLM({args}, prior={self.prior!r}, prior_scale={self.prior_scale!r})"

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return False
        if isinstance(self.family, CustomFamily) or isinstance(other.family, CustomFamily):
            return self.family is other.family and self._prior.to_dict() == other._prior.to_dict()
        return other.to_dict() == self.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))

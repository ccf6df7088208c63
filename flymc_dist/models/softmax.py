"""Softmax regression: the GLM of :class:`~flymc_dist.models.families.SoftmaxFamily` (K
linear predictors per row, Böhning's or the one-vs-each bound; DESIGN.md §2), under the
name users know."""

from __future__ import annotations

from flymc_dist.models.families import SOFTMAX_BOUNDS, SoftmaxFamily
from flymc_dist.models.glm import GLM

__all__ = ["SoftmaxRegression"]


class SoftmaxRegression(GLM):
    """K-class softmax regression, ``y in {0, ..., K-1}``, ``theta`` of shape (K, D):
    ``GLM(SoftmaxFamily(n_classes, bound=bound), prior, prior_scale)``.

    Parameters
    ----------
    n_classes
        K >= 2.
    prior
        ``"normal"``, ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    bound
        FlyMC's bound: ``"bohning"`` (default; fixed curvature, tight at its tight points)
        or ``"one_vs_each"`` (a curvature that falls with each row's margins, with a small
        gap at its tight points; see :class:`~flymc_dist.models.families.SoftmaxFamily`).
    """

    name = "softmax"

    def __init__(
        self,
        n_classes: int,
        prior: str = "normal",
        prior_scale: float = 1.0,
        bound: str = SOFTMAX_BOUNDS[0],
    ) -> None:
        super().__init__(
            SoftmaxFamily(n_classes, bound=bound), prior=prior, prior_scale=prior_scale
        )

    @property
    def n_classes(self) -> int:
        """K."""
        return self.family.n_classes

    @property
    def bound(self) -> str:
        """The bound's name."""
        return self.family.bound_name

    def to_dict(self) -> dict:
        """``{"name": "softmax", "n_classes": K, "prior": ..., "prior_scale": ...,
        "bound": ...}``."""
        return {
            "name": self.name,
            "n_classes": self.n_classes,
            "prior": self.prior,
            "prior_scale": self.prior_scale,
            "bound": self.bound,
        }

    def __repr__(self) -> str:
        return (
            f"SoftmaxRegression(n_classes={self.n_classes}, prior={self.prior!r}, "
            f"prior_scale={self.prior_scale!r}, bound={self.bound!r})"
        )

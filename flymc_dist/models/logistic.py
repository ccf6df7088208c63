"""Logistic regression: the GLM of :class:`~flymc_dist.models.families.LogisticFamily`
(Bernoulli, logit link, the Jaakkola–Jordan bound; DESIGN.md §2), under the name
users know."""

from __future__ import annotations

from flymc_dist.models.families import XI_UNTUNED, LogisticFamily
from flymc_dist.models.glm import GLM

__all__ = ["LogisticRegression"]


class LogisticRegression(GLM):
    """Binary logistic regression, ``y in {0, 1}``, ``P(y = 1) = sigmoid(theta @ x)``:
    ``GLM(LogisticFamily(xi_untuned), prior, prior_scale)``.

    Parameters
    ----------
    prior
        ``"normal"``, ``"laplace"`` or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    xi_untuned
        Tight point ``|s|`` used for untuned bounds.
    """

    name = "logistic"

    def __init__(
        self, prior: str = "normal", prior_scale: float = 1.0, xi_untuned: float = XI_UNTUNED
    ) -> None:
        super().__init__(LogisticFamily(xi_untuned), prior=prior, prior_scale=prior_scale)

    @property
    def xi_untuned(self) -> float:
        """The untuned tight point."""
        return self.family.xi_untuned

    def to_dict(self) -> dict:
        """``{"name": "logistic", "prior": ..., "prior_scale": ..., "xi_untuned": ...}``."""
        return {
            "name": self.name,
            "prior": self.prior,
            "prior_scale": self.prior_scale,
            "xi_untuned": self.xi_untuned,
        }

    def __repr__(self) -> str:
        return (
            f"LogisticRegression(prior={self.prior!r}, prior_scale={self.prior_scale!r}, "
            f"xi_untuned={self.xi_untuned!r})"
        )

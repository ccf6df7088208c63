"""Robust (Student-t) linear regression: the GLM of
:class:`~flymc_dist.models.families.StudentTFamily` (the tangent bound in ``r²``; DESIGN.md
§2), under the name users know."""

from __future__ import annotations

from flymc_dist.models.families import STUDENT_T_NU, STUDENT_T_SCALE, StudentTFamily
from flymc_dist.models.glm import GLM

__all__ = ["RobustRegression"]


class RobustRegression(GLM):
    """Linear regression with Student-t noise, ``y = theta @ x + sigma * t_nu``:
    ``GLM(StudentTFamily(nu, scale), prior, prior_scale)``.

    Parameters
    ----------
    nu
        Degrees of freedom, > 0 (as in Maclaurin & Adams 2014 by default: 4).
    scale
        Noise scale ``sigma`` > 0.
    prior
        ``"normal"``, ``"laplace"`` (default) or ``"flat"``.
    prior_scale
        Prior sd (normal) or scale ``b`` (Laplace); > 0.
    """

    name = "robust"

    def __init__(
        self,
        nu: float = STUDENT_T_NU,
        scale: float = STUDENT_T_SCALE,
        prior: str = "laplace",
        prior_scale: float = 1.0,
    ) -> None:
        super().__init__(StudentTFamily(nu, scale), prior=prior, prior_scale=prior_scale)

    @property
    def nu(self) -> float:
        """Degrees of freedom."""
        return self.family.nu

    @property
    def scale(self) -> float:
        """Noise scale."""
        return self.family.scale

    def to_dict(self) -> dict:
        """``{"name": "robust", "nu": ..., "scale": ..., "prior": ..., "prior_scale": ...}``."""
        return {
            "name": self.name,
            "nu": self.nu,
            "scale": self.scale,
            "prior": self.prior,
            "prior_scale": self.prior_scale,
        }

    def __repr__(self) -> str:
        return (
            f"RobustRegression(nu={self.nu!r}, scale={self.scale!r}, prior={self.prior!r}, "
            f"prior_scale={self.prior_scale!r})"
        )

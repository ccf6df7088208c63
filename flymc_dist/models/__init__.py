"""Likelihoods with collapsible per-datum lower bounds, and their priors."""

from __future__ import annotations

from flymc_dist.models.base import BoundStats, Model
from flymc_dist.models.families import (
    FAMILIES,
    BinomialFamily,
    CustomFamily,
    Family,
    GaussianFamily,
    LogisticFamily,
    NegativeBinomialFamily,
    SoftmaxFamily,
    StudentTFamily,
)
from flymc_dist.models.glm import GLM
from flymc_dist.models.logistic import LogisticRegression
from flymc_dist.models.priors import VALID_PRIORS, Prior
from flymc_dist.models.robust import RobustRegression
from flymc_dist.models.softmax import SoftmaxRegression

__all__ = [
    "FAMILIES",
    "GLM",
    "MODELS",
    "BinomialFamily",
    "CustomFamily",
    "Family",
    "GaussianFamily",
    "LogisticFamily",
    "NegativeBinomialFamily",
    "SoftmaxFamily",
    "StudentTFamily",
    "VALID_PRIORS",
    "BoundStats",
    "LogisticRegression",
    "Model",
    "Prior",
    "RobustRegression",
    "SoftmaxRegression",
    "make_model",
    "model_from_dict",
]

#: model name -> class
MODELS: dict[str, type[Model]] = {
    "logistic": LogisticRegression,
    "softmax": SoftmaxRegression,
    "robust": RobustRegression,
    "glm": GLM,
}


def _model_class(name: object) -> type[Model]:
    if not isinstance(name, str) or name.strip().lower() not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names are {', '.join(map(repr, MODELS))}")
    return MODELS[name.strip().lower()]


def make_model(name: str, **kwargs: object) -> Model:
    """Build a model by name (for the CLI).

    Parameters
    ----------
    name
        ``"logistic"``, ``"softmax"``, ``"robust"`` or ``"glm"`` (case-insensitive).
    **kwargs
        Constructor arguments, e.g. ``n_classes=10`` for softmax, ``nu=4.0`` for
        robust, ``family="negative_binomial", dispersion=2.0`` for glm,
        ``prior="laplace"``, ``prior_scale=2.0``.

    Returns
    -------
    Model
        The model instance.

    Raises
    ------
    ValueError
        Unknown name, unknown or missing arguments, or invalid argument values.
    """
    cls = _model_class(name)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"bad arguments for model {cls.name!r}: {err}") from err


def model_from_dict(d: dict) -> Model:
    """Rebuild a model from :meth:`Model.to_dict` output.

    Parameters
    ----------
    d
        A mapping with a ``"name"`` key and the constructor arguments.

    Returns
    -------
    Model
        A model equal to the one that produced ``d``.
    """
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"expected a dict with a 'name' key, got {d!r}")
    kwargs = {k: v for k, v in d.items() if k != "name"}
    return make_model(d["name"], **kwargs)

"""What the ``flymc`` subcommands share: the usage error, the parser class, output helpers."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any, NoReturn

from flymc_dist._paths import is_url


class CLIError(Exception):
    """Bad input or usage: reported as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors become :class:`CLIError` (one line, no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')")


# --------------------------------------------------------------------------- small helpers


def say(text: str = "") -> None:
    print(text, flush=True)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def usage_error(text: str) -> None:
    sys.stderr.write(f"flymc: error: {_one_line(text)}\n")
    sys.stderr.flush()


def storage_options_from(args: argparse.Namespace, *paths: str) -> dict[str, Any] | None:
    """The ``--storage-option`` pairs as a dict (None if none); they need a URL among ``paths``
    (when any are given)."""
    pairs = getattr(args, "storage_option", None) or []
    if not pairs:
        return None
    if paths and not any(is_url(p) for p in paths):
        raise CLIError(
            "--storage-option applies only to fsspec URLs (s3://…), and no path here is one"
        )
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CLIError(f"--storage-option {key} given twice")
        out[key] = value
    return out


def url_options(path: str, options: dict[str, Any] | None) -> dict[str, Any] | None:
    """``options`` for a URL ``path``, None for a local one."""
    return options if is_url(path) else None


def progress_from(args: argparse.Namespace) -> bool | None:
    """``False`` with ``--no-progress``; else None (on for a terminal, off under ``CI``)."""
    return False if getattr(args, "no_progress", False) else None


def fmt(x: float, spec: str = ".3g") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "n/a"


def percent(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    return f"{100 * x:.3g}%"

"""``flymc run``'s flags generated from the API's own option definitions: the fields of
:class:`~flymc_dist.options.FlyMC`, :class:`~flymc_dist.options.Austerity` and
:class:`~flymc_dist.options.Placement`, and the constructor options of every θ-kernel —
so every option of :func:`flymc_dist.sample` is reachable from the command line, with the
API's default and doc, and the two cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from typing import Any

from flymc_dist.cli.common import CLIError
from flymc_dist.kernels import KERNELS, Kernel, get_kernel
from flymc_dist.options import boolean

__all__ = [
    "FLAG_NAMES",
    "add_kernel_flags",
    "add_option_flags",
    "flag_of",
    "kernel_from_args",
    "kernel_option_names",
    "options_from_args",
]

#: options whose flag is not ``--`` + the name with dashes (kept from earlier releases)
FLAG_NAMES = {"n_workers": "--workers"}


def flag_of(name: str) -> str:
    """The command-line flag of the option ``name``."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _dest(name: str) -> str:
    return f"opt_{name}"


def _parser_of(name: str, type_text: str, check: Any) -> Any:
    """An argparse type for a field: its words (``auto``, ``none``, ``true``…), else a
    number or a string as its type says; then the field's own check."""
    words = getattr(check, "words", ())

    def parse(text: str) -> Any:
        for w in words:
            if str(w).lower() == text.strip().lower():
                value: Any = w
                break
        else:
            value = text
            for kind in (int, float):
                if kind.__name__ in type_text:
                    try:
                        value = kind(text)
                        break
                    except ValueError:
                        continue
        if check is None:
            return value
        try:
            return check(flag_of(name), value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = name
    return parse


def add_option_flags(group: Any, cls: type, prefix: str = "") -> None:
    """One flag per field of the options class ``cls`` (default None: not given, so the
    API's default applies; the help says what it is)."""
    for f in dataclasses.fields(cls):
        check = f.metadata.get("check")
        doc = prefix + f.metadata["doc"]
        if "default" not in doc:
            doc += f" (default {_shown(f.default)})"
        if check is boolean:
            group.add_argument(
                flag_of(f.name),
                dest=_dest(f.name),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=doc,
            )
            continue
        words = [str(w).lower() for w in getattr(check, "words", ())]
        group.add_argument(
            flag_of(f.name),
            dest=_dest(f.name),
            type=_parser_of(f.name, str(f.type), check),
            default=None,
            metavar=_metavar(f.name, str(f.type), words),
            help=doc,
        )


def _metavar(name: str, type_text: str, words: list[str]) -> str:
    """``auto|true|false``, ``auto|Q_DB``, ``N_SHARDS``: the words a value may be, and
    its name where it may be a number."""
    number = any(k in type_text for k in ("int", "float"))
    return "|".join([*words, name.upper()] if number or not words else words)


def _shown(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return str(value).lower()
    return str(value)


def options_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` given on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, _dest(f.name), None)
        if value is not None:
            out[f.name] = value
    return out


# ------------------------------------------------------------------ the kernels' options


def kernel_option_names() -> dict[str, list[str]]:
    """Each kernel option and the kernels that take it."""
    out: dict[str, list[str]] = {}
    for kname, cls in KERNELS.items():
        for p in inspect.signature(cls).parameters:
            out.setdefault(p, []).append(kname)
    return out


def _param_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``name -> (type, first sentence)`` from the numpydoc Parameters section of ``cls``."""
    doc = inspect.getdoc(cls) or ""
    m = re.search(r"Parameters\n-+\n(.*?)(\n\n[A-Z][a-z]+\n-+\n|\Z)", doc, re.S)
    out: dict[str, tuple[str, str]] = {}
    if m is None:
        return out
    name, lines = None, []
    for line in [*m.group(1).splitlines(), "END"]:
        if line and not line.startswith(" "):
            if name is not None:
                text = " ".join(s.strip() for s in lines)
                first = re.sub(r"\s*\((default|e\.g\.)[^)]*\)", "", text.split(". ")[0])
                first = re.sub(r";?\s*default\b.*$", "", first).replace("``", "")
                first = re.sub(r";?\s*see :\w+:`[^`]*`", "", first)
                if first.count("(") > first.count(")"):
                    first = first[: first.rindex("(")]
                for n in name.split(","):
                    out[n.strip()] = ("", first.rstrip(". "))
            name, lines = line.split(":")[0], []
        else:
            lines.append(line)
    return out


def add_kernel_flags(group: Any) -> None:
    """One flag per option of any θ-kernel (its type and doc from the kernel classes); a
    flag the chosen kernel does not take is refused when the run starts."""
    params: dict[str, inspect.Parameter] = {}
    docs: dict[str, str] = {}
    for cls in KERNELS.values():
        for name, p in inspect.signature(cls).parameters.items():
            params.setdefault(name, p)
            text = _param_docs(cls).get(name, ("", ""))[1]
            if len(text) > len(docs.get(name, "")):
                docs[name] = text
    for name, p in params.items():
        defaults: dict[str, list[str]] = {}
        for kname in kernel_option_names()[name]:
            default = inspect.signature(KERNELS[kname]).parameters[name].default
            defaults.setdefault(_shown(default), []).append(kname)
        shown = "; ".join(f"{'/'.join(ks)}: default {d}" for d, ks in defaults.items())
        doc = f"{docs.get(name, name)} ({shown})"
        type_text = str(p.annotation)
        if type_text == "bool":
            group.add_argument(
                flag_of(name),
                dest=_dest(f"kernel_{name}"),
                action=argparse.BooleanOptionalAction,
                default=None,
                help=doc,
            )
        else:
            group.add_argument(
                flag_of(name),
                dest=_dest(f"kernel_{name}"),
                type=_kernel_value(name, type_text),
                default=None,
                metavar=name.upper(),
                help=doc,
            )


def _kernel_value(name: str, type_text: str) -> Any:
    def parse(text: str) -> Any:
        for kind in (int, float):
            if kind.__name__ in type_text:
                try:
                    return kind(text)
                except ValueError:
                    continue
        if "str" in type_text:
            return text
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")

    parse.__name__ = name
    return parse


def kernel_from_args(args: argparse.Namespace, kernel: str) -> Kernel | str:
    """The kernel named ``kernel`` with the kernel flags given (its name when none are)."""
    given = {}
    for name, takers in kernel_option_names().items():
        value = getattr(args, _dest(f"kernel_{name}"), None)
        if value is None:
            continue
        if kernel not in takers:
            raise CLIError(f"{flag_of(name)} is not an option of kernel {kernel!r}")
        given[name] = value
    if not given:
        return kernel
    try:
        return get_kernel(kernel, **given)
    except ValueError as err:
        named = [flag_of(k) for k in given if str(err).startswith(k)]
        raise CLIError(f"{named[0] if named else '--kernel'}: {err}") from None

"""Progress on stderr (tqdm): the sampling bar and each set-up pass, on when asked or for a
terminal outside CI, silent otherwise, and never a change to the draws."""

from __future__ import annotations

import os
import re
import select
import sys

import numpy as np
import pytest
from synthetic import logistic_rows
from tqdm import tqdm

import flymc_dist as fd
from flymc_dist.progress import Progress, SetupProgress, progress_enabled

#: the set-up passes each algorithm shows, in order (in-process, MAP-tuned)
PHASES = {
    "flymc": ["load", "MAP search", "exact rows", "bound statistics and first draw of z"],
    "regular": ["load", "MAP search", "first evaluation"],
    "austerity": ["load", "MAP search", "bound statistics"],
}


def _lines(err: str) -> list[str]:
    """What a terminal would show: the last ``\\r``-separated state of every line, without
    the spaces tqdm pads a shorter state with to blank the longer one it overwrote."""
    return [line.split("\r")[-1].rstrip(" ") for line in err.split("\n") if line.strip("\r")]


def _si(text: str) -> float:
    """``"1.23k"`` -> 1230.0 (tqdm's SI prefixes)."""
    scale = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    return float(text[:-1]) * scale[text[-1]] if text[-1] in scale else float(text)


def _sample(data: object, algorithm: str, progress: bool | None) -> fd.Result:
    return fd.sample(
        fd.LogisticRegression(),
        data,
        algorithm=algorithm,
        kernel="rwmh",
        num_warmup=30,
        num_samples=30,
        chains=2,
        seed=4,
        client="synchronous",
        progress=progress,
    )


@pytest.mark.parametrize("algorithm", ["flymc", "regular", "austerity"])
def test_progress_shows_each_setup_pass_then_the_bar_and_leaves_the_draws(
    tmp_path, capsys: pytest.CaptureFixture[str], algorithm: str
) -> None:
    """Forced on, each set-up pass ends in one line (rows, rows/s, bytes/s where its rows
    are known) in the order the set-up runs them, then the sampling bar with it/s,
    acceptance and bright rows; forced off, nothing at all; the draws are the same."""
    X, y = logistic_rows(3000)
    ds = fd.from_numpy(X, y, str(tmp_path / "d.zarr"))
    capsys.readouterr()
    on = _sample(ds, algorithm, True)
    out, err = capsys.readouterr()
    assert out == ""
    lines = _lines(err)
    setup = [line.split(":")[0] for line in lines if not line.startswith(("sampling", "aust"))]
    assert setup == PHASES[algorithm]
    load = next(line for line in lines if line.startswith("load:"))
    # the store's float64 rows: 3 features and the target, 32 bytes each
    assert re.fullmatch(
        r"load: 3\.00k rows in [\d.]+ s, [\d.]+[kMG]? rows/s, [\d.]+[kMG]?B/s, from the store", load
    )
    map_line = next(line for line in lines if line.startswith("MAP search:"))
    m = re.fullmatch(r"MAP search: (\S+) rows in .*, (\d+) full passes", map_line)
    assert m is not None and int(m[2]) > 1  # no subsample below 2^18 rows
    assert m[1] == tqdm.format_sizeof(int(m[2]) * 3000)
    label = "austerity" if algorithm == "austerity" else "sampling"
    bar = lines[-1]
    assert bar.startswith(f"{label}: 100%") and "60/60" in bar and "it/s" in bar
    assert re.search(r"accept \d\.\d{3}, bright [\d,]+\]$", bar)
    assert any(line.startswith(f"{label} (warm-up):") for line in err.split("\r"))

    off = _sample(ds, algorithm, False)
    assert capsys.readouterr() == ("", "")
    np.testing.assert_array_equal(on.samples, off.samples)
    for k in on.stats:
        np.testing.assert_array_equal(on.stats[k], off.stats[k])


def test_the_default_is_silent_where_stderr_is_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``progress=None`` (the default): pytest's captured stderr is no terminal."""
    _sample(logistic_rows(500), "flymc", None)
    assert capsys.readouterr() == ("", "")


def test_the_default_rule_on_a_real_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a pseudo-terminal the default is on, unless ``CI`` is set; True / False force."""
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            monkeypatch.delenv("CI", raising=False)
            assert progress_enabled(None) is True
            monkeypatch.setenv("CI", "true")
            assert progress_enabled(None) is False
            assert progress_enabled(True) is True
            monkeypatch.delenv("CI")
            assert progress_enabled(False) is False
    finally:
        os.close(master)


def test_a_pass_that_fails_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """The line of a pass that raises ends in "failed", and the error goes on."""
    shown = SetupProgress(True, row_bytes=80)
    with pytest.raises(ZeroDivisionError), shown.phase("bound statistics", 1000):
        1 / 0  # noqa: B018
    assert re.fullmatch(
        r"bound statistics: failed after [\d.]+ s", _lines(capsys.readouterr().err)[-1]
    )


def test_a_pass_whose_rows_are_unknown_shows_its_seconds_and_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = SetupProgress(True, row_bytes=80)
    with shown.phase("exact rows") as p:
        p.note = "12 rows chosen"
    with shown.phase("bound statistics", 2_000_000):
        pass
    first, second = _lines(capsys.readouterr().err)
    assert re.fullmatch(r"exact rows: [\d.]+ s, 12 rows chosen", first)
    # 2M rows of 80 bytes: the bytes per second are 80 times the rows per second
    m = re.fullmatch(r"bound statistics: 2\.00M rows in [\d.]+ s, (\S+) rows/s, (\S+)B/s", second)
    assert m is not None
    assert _si(m[2]) / _si(m[1]) == pytest.approx(80, rel=0.02)


def test_the_sampling_bar_off_counts_and_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    bar = Progress(10, enabled=False)
    for i in range(10):
        bar.update({"accepted": np.array([i % 2 == 0, True]), "n_bright": np.array([3, 5])})
    bar.close()
    assert capsys.readouterr() == ("", "")
    assert bar.count == 10 and bar.accepted / bar.n_acc == pytest.approx(0.75)


def _read_all(master: int) -> str:
    """Everything written to the pseudo-terminal (its other end closed): the kernel
    hands it over in pieces, some maybe after a first read."""
    chunks = []
    while select.select([master], [], [], 2.0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the other end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_a_terminal_that_reports_no_size_still_shows_the_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pseudo-terminal without a size (0 × 0, as under ``script`` without a terminal
    around it): tqdm alone printed empty lines there."""
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            assert os.get_terminal_size(tty.fileno()).columns == 0
            monkeypatch.setattr(sys, "stderr", tty)
            monkeypatch.delenv("CI", raising=False)
            with SetupProgress(None, row_bytes=8).phase("bound statistics", 1000):
                pass
            bar = Progress(3, None)
            for _ in range(3):
                bar.update({"accepted": np.array([True]), "n_bright": np.array([7])})
            bar.close()
            tty.flush()
        shown = _read_all(master)
    finally:
        os.close(master)
    lines = _lines(shown.replace("\r\n", "\n"))
    assert lines[0].startswith("bound statistics: 1.00k rows in ")
    assert lines[1].startswith("sampling: 100%") and "3/3" in lines[1]
    assert lines[1].endswith("accept 1.000, bright 7]")

"""Shared benchmark helpers: alternating repeats, medians with min-max, and docs/benchmarks.md sections."""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values))

    def fmt(self, scale: float = 1.0, digits: int = 2) -> str:
        return f"{self.median * scale:.{digits}f} ({self.low * scale:.{digits}f}–{self.high * scale:.{digits}f})"


def alternate(baseline: Callable[[], float], candidate: Callable[[], float], repeats: int,
              progress: str = "") -> tuple[list[float], list[float]]:
    """Run baseline and candidate alternately `repeats` times each; each returns seconds."""
    base, cand = [], []
    for i in range(repeats):
        base.append(baseline())
        cand.append(candidate())
        if progress:
            print(f"\r  {progress}: repeat {i + 1}/{repeats}", end="", flush=True)
    if progress:
        print()
    return base, cand


def child_rows(stdout: str) -> list:
    """The JSON rows a bench's child process printed: UCX writes its warnings to stdout too,
    before the rows or (a leak report at exit) after them."""
    import json

    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith(("[{", "[]"))))


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine_line() -> str:
    import os
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(name: str, body: str) -> None:
    """Replace (or append) the section between markers for `name` in docs/benchmarks.md."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n\nEvery figure is measured, never asserted in tests.\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def table(columns: list[str], rows: list[str]) -> list[str]:
    """Markdown table lines: header, separator, rows."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns), *rows]


def publish(name: str, title: str, intro: str, tables: list[list[str]], *, write: bool,
            chart: dict[str, dict[str, list[float]]] | None = None, unit: str = "GB/s") -> None:
    """Print where the results went and write the section `name` of docs/benchmarks.md; with
    `chart` (group -> system -> values over repeats), also docs/img/bench-NAME.png, linked there."""
    picture = [""] if chart is None else ["", f"![{title}](img/bench-{name}.png)"]
    body = "\n".join([f"## {title}", "", intro, *(line for t in tables for line in ["", *t]), *picture])
    if write:
        write_section(name, body)
        if chart is not None:
            bar_chart(DOC.parent / "img" / f"bench-{name}.png", title, chart, unit)
        print("wrote docs/benchmarks.md")


def bar_chart(path: Path, title: str, groups: dict[str, dict[str, list[float]]], unit: str) -> None:
    """Grouped bars: the median per system in each group, whiskers from min to max."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(groups)), 4))
    for i, system in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        values = [groups[name].get(system, [0.0]) for name in groups]
        medians = [statistics.median(v) for v in values]
        errors = [[m - min(v) for m, v in zip(medians, values)], [max(v) - m for m, v in zip(medians, values)]]
        ax.bar(xs, medians, width=width, yerr=errors, capsize=3, label=system)
    ax.set_xticks(range(len(groups)), [g.replace(", ", "\n") for g in groups], fontsize=8)  # "what, size": two lines
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def disk_bench_args(doc: str, *, repeats: int, quick_help: str):
    """The options the NVMe benchmarks share: --repeats, --quick, --dir, --no-write."""
    import argparse
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--dir", default=None, help="directory on the device to measure (default: a temp dir)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    return parser.parse_args()


def managed_venv(path: Path, installs: list[list[str]], label: str) -> str:
    """An anchor system's own environment, made once: `installs` are pip argument lists, run in
    order. Returns its python."""
    python = path / "bin" / "python"
    if not (path / ".installed").exists():
        print(f"  installing {label} into {path.name} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        for args in installs:
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                           check=True)
        (path / ".installed").touch()
    return str(python)

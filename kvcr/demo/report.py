"""What the demo shows: the live table, the final summary (JSON) and the chart (PNG)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from .driver import Outcome

SOURCES = ("dram", "nvme", "peer", "computed")
MiB = 2**20


def page_sources(outcomes: list[Outcome], page_size: int) -> Counter:
    c: Counter = Counter()
    for o in outcomes:
        c["dram"] += o.dram_pages
        c["nvme"] += o.nvme_pages
        c["peer"] += o.peer_pages
        c["computed"] += -(-o.prompt_tokens // page_size) - o.dram_pages - o.nvme_pages - o.peer_pages
    return c


def oracle_summary(outcomes: list[Outcome]) -> dict:
    checked = [o.oracle for o in outcomes if o.oracle is not None]
    return {"checks": len(checked), "mismatches": sum(not x["ok"] for x in checked),
            "chunked_bitwise_equal": sum(x["chunked_equal"] for x in checked),
            "max_abs_vs_one_shot": max((x["full_max_abs"] for x in checked), default=0.0)}


def summarize(outcomes: list[Outcome], workers: dict[str, dict], *, page_size: int, elapsed_s: float,
              options: dict) -> dict:
    per_worker = {}
    for name, info in workers.items():
        mine = [o for o in outcomes if o.worker == name]
        tiers = info["tiers"]
        per_worker[name] = {"requests": len(mine), **dict(page_sources(mine, page_size)),
                            "pulled_mib": sum(o.peer_pages for o in mine) * tiers["page_bytes"] / MiB,
                            "prefill_s": sum(o.prefill_s for o in mine), "saved_s": sum(o.saved_s for o in mine),
                            "dram_pages_held": tiers["dram_pages"], "nvme_pages_held": tiers["nvme_pages"],
                            "events": tiers["events"]}
    totals = dict(page_sources(outcomes, page_size))
    return {"ok": None, "elapsed_s": elapsed_s, "options": options, "requests": len(outcomes),
            "errors": [o.error for o in outcomes if o.error], "page_sources": totals,
            "peer_hits": totals.get("peer", 0), "oracle": oracle_summary(outcomes), "workers": per_worker,
            "phases": {p: dict(page_sources([o for o in outcomes if o.phase == p], page_size))
                       for p in dict.fromkeys(o.phase for o in outcomes)},
            "outcomes": [asdict(o) for o in outcomes]}


def live_table(phase: str, done: int, total: int, workers: dict[str, dict], rates: dict[str, float],
               oracle: dict) -> Table:
    table = Table(title=f"kvcr demo: phase {phase}, {done}/{total} requests; oracle {oracle['checks']} checks, "
                        f"{oracle['mismatches']} mismatches")
    for col in ("worker", "requests", "DRAM pages", "NVMe pages", "hits DRAM", "hits NVMe", "hits peer",
                "pulled MiB", "prefill saved s", "events/s"):
        table.add_column(col, justify="right")
    for name, info in workers.items():
        s, t = info["stats"], info["tiers"]
        table.add_row(name, str(s["requests"]), f"{t['dram_pages']}/{t['dram_capacity']}", str(t["nvme_pages"]),
                      str(s["dram_pages"]), str(s["nvme_pages"]), str(s["peer_pages"]),
                      f"{s['peer_pages'] * t['page_bytes'] / MiB:.1f}", f"{s['saved_s']:.2f}",
                      f"{rates.get(name, 0.0):.0f}")
    return table


def summary_table(summary: dict) -> Table:
    table = Table(title=f"kvcr demo summary ({summary['requests']} requests in {summary['elapsed_s']:.1f} s)")
    for col in ("worker", "requests", *(f"pages {s}" for s in SOURCES), "pulled MiB", "prefill s", "saved s"):
        table.add_column(col, justify="right")
    for name, w in summary["workers"].items():
        table.add_row(name, str(w["requests"]), *(str(w.get(s, 0)) for s in SOURCES), f"{w['pulled_mib']:.1f}",
                      f"{w['prefill_s']:.2f}", f"{w['saved_s']:.2f}")
    return table


def chart(summary: dict, path: Path) -> None:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"dram": "#2b8cbe", "nvme": "#7bccc4", "peer": "#f03b20", "computed": "#bdbdbd"}
    for ax, groups, title in ((axes[0], summary["workers"], "prompt pages by source, per worker"),
                              (axes[1], summary["phases"], "prompt pages by source, per phase")):
        names = list(groups)
        bottom = [0] * len(names)
        for src in SOURCES:
            values = [groups[n].get(src, 0) for n in names]
            ax.bar(names, values, bottom=bottom, label=src, color=colors[src])
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(title)
        ax.set_ylabel("pages")
    axes[0].legend()
    oracle = summary["oracle"]
    fig.suptitle(f"kvcr demo: {summary['peer_hits']} pages pulled from peers, oracle {oracle['checks']} checks, "
                 f"{oracle['mismatches']} mismatches")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""What the demo shows: the live table, the final summary (JSON) and the chart (PNG)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from .driver import Outcome

SOURCES = ("dram", "nvme", "peer", "computed")  # `kvcr worker`: its runner's tiers, a peer, or computed
# SGLang: its own device (L1) and host (L2) pools, then its kvcr backend (L3): the runner's DRAM and NVMe, a peer
SGLANG_SOURCES = ("device", "host", "dram", "nvme", "peer", "computed")
MiB = 2**20


def sources_of(engine: str) -> tuple[str, ...]:
    return SGLANG_SOURCES if engine == "sglang" else SOURCES


def page_sources(outcomes: list[Outcome], page_size: int, sources: tuple[str, ...] = SOURCES) -> Counter:
    c: Counter = Counter()
    for o in outcomes:
        cached = {"device": o.device_pages, "host": o.host_pages, "dram": o.dram_pages, "nvme": o.nvme_pages,
                  "peer": o.peer_pages}
        for src, n in cached.items():
            if src in sources:
                c[src] += n
        c["computed"] += -(-o.prompt_tokens // page_size) - sum(cached.values())
    return c


def oracle_summary(outcomes: list[Outcome], engine: str = "worker") -> dict:
    checked = [o.oracle for o in outcomes if o.oracle is not None]
    out = {"checks": len(checked), "mismatches": sum(not x["ok"] for x in checked)}
    if engine == "sglang":
        # SGLang: each cached answer against a cold computation of the same prompt ids (sglang_driver.py)
        from .sglang_driver import ORACLE_TOLERANCE

        return {**out, "method": "a cold computation of the same prompt ids on a reference engine "
                                 "(--disable-radix-cache, no hierarchical cache): the same output token ids, "
                                 "logprobs (chosen and top by rank) within the tolerance",
                "tolerance": ORACLE_TOLERANCE, "output_ids_equal": sum(x["output_ids_equal"] for x in checked),
                "bitwise_equal": sum(x["bitwise_equal"] for x in checked),
                "top_logprobs": max((x["top_logprobs"] for x in checked), default=0),
                "max_abs_logprob": max((x["max_abs_logprob"] for x in checked), default=0.0),
                "prompt_ids_checked": sum(o.prompt_ids_match is not None for o in outcomes),
                "prompt_ids_mismatches": sum(o.prompt_ids_match is False for o in outcomes)}
    return {**out, "chunked_bitwise_equal": sum(x["chunked_equal"] for x in checked),
            "max_abs_vs_one_shot": max((x["full_max_abs"] for x in checked), default=0.0)}


def summarize(outcomes: list[Outcome], workers: dict[str, dict], *, page_size: int, elapsed_s: float,
              options: dict, engine: str = "worker") -> dict:
    sources = sources_of(engine)
    per_worker = {}
    for name, info in workers.items():
        mine = [o for o in outcomes if o.worker == name]
        tiers = info["tiers"]
        per_worker[name] = {"requests": len(mine), **dict(page_sources(mine, page_size, sources)),
                            "pulled_mib": sum(o.peer_pages for o in mine) * tiers["page_bytes"] / MiB,
                            "prefill_s": sum(o.prefill_s for o in mine), "saved_s": sum(o.saved_s for o in mine),
                            "dram_pages_held": tiers["dram_pages"], "nvme_pages_held": tiers["nvme_pages"],
                            "events": tiers["events"], **info.get("runner", {})}
    totals = dict(page_sources(outcomes, page_size, sources))
    return {"ok": None, "engine": engine, "sources": list(sources), "elapsed_s": elapsed_s, "options": options,
            "requests": len(outcomes), "errors": [o.error for o in outcomes if o.error], "page_sources": totals,
            "peer_hits": totals.get("peer", 0), "oracle": oracle_summary(outcomes, engine), "workers": per_worker,
            "phases": {p: dict(page_sources([o for o in outcomes if o.phase == p], page_size, sources))
                       for p in dict.fromkeys(o.phase for o in outcomes)},
            "outcomes": [asdict(o) for o in outcomes]}


def live_table(phase: str, done: int, total: int, workers: dict[str, dict], rates: dict[str, float],
               oracle: dict, engine: str = "worker") -> Table:
    table = Table(title=f"kvcr demo: phase {phase}, {done}/{total} requests; oracle {oracle['checks']} checks, "
                        f"{oracle['mismatches']} mismatches")
    sglang = engine == "sglang"
    hits = ("hits device", "hits host", "hits kvcr DRAM", "hits kvcr NVMe") if sglang else ("hits DRAM", "hits NVMe")
    saved = "saved s vs cold" if sglang else "prefill saved s"
    for col in ("worker", "requests", "DRAM pages", "NVMe pages", *hits, "hits peer", "pulled MiB", saved,
                "events/s"):
        table.add_column(col, justify="right")
    for name, info in workers.items():
        s, t = info["stats"], info["tiers"]
        tier_hits = ([str(s["device_pages"]), str(s["host_pages"])] if sglang else []) + \
            [str(s["dram_pages"]), str(s["nvme_pages"])]
        table.add_row(name, str(s["requests"]), f"{t['dram_pages']}/{t['dram_capacity']}", str(t["nvme_pages"]),
                      *tier_hits, str(s["peer_pages"]), f"{s['peer_pages'] * t['page_bytes'] / MiB:.1f}",
                      f"{s['saved_s']:.2f}", f"{rates.get(name, 0.0):.0f}")
    return table


def summary_table(summary: dict) -> Table:
    sources = summary.get("sources", SOURCES)
    table = Table(title=f"kvcr demo summary ({summary['requests']} requests in {summary['elapsed_s']:.1f} s)")
    sglang = summary.get("engine") == "sglang"  # SGLang reports no prefill time: only the saving vs cold
    times = ("saved s vs cold",) if sglang else ("prefill s", "saved s")
    for col in ("worker", "requests", *(f"pages {s}" for s in sources), "pulled MiB", *times):
        table.add_column(col, justify="right")
    for name, w in summary["workers"].items():
        seconds = [f"{w['saved_s']:.2f}"] if sglang else [f"{w['prefill_s']:.2f}", f"{w['saved_s']:.2f}"]
        table.add_row(name, str(w["requests"]), *(str(w.get(s, 0)) for s in sources), f"{w['pulled_mib']:.1f}",
                      *seconds)
    return table


def chart(summary: dict, path: Path) -> None:
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = summary.get("sources", SOURCES)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"device": "#54278f", "host": "#9e9ac8", "dram": "#2b8cbe", "nvme": "#7bccc4", "peer": "#f03b20",
              "computed": "#bdbdbd"}
    labels = {"dram": "kvcr DRAM", "nvme": "kvcr NVMe"} if summary.get("engine") == "sglang" else {}
    for ax, groups, title in ((axes[0], summary["workers"], "prompt pages by source, per worker"),
                              (axes[1], summary["phases"], "prompt pages by source, per phase")):
        names = list(groups)
        bottom = [0] * len(names)
        for src in sources:
            values = [groups[n].get(src, 0) for n in names]
            ax.bar(names, values, bottom=bottom, label=labels.get(src, src), color=colors[src])
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(title)
        ax.set_ylabel("pages")
    axes[0].legend()
    oracle = summary["oracle"]
    engine = " on SGLang" if summary.get("engine") == "sglang" else ""
    fig.suptitle(f"kvcr demo{engine}: {summary['peer_hits']} pages pulled from peers, oracle {oracle['checks']} "
                 f"checks, {oracle['mismatches']} mismatches")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

"""`make fuzz`: coverage-guided atheris (libFuzzer) campaigns over every decoder of outside input.

    .venv/bin/python -m tests.fuzz.campaign [--seconds 60] [TARGET ...]

Each target (tests/fuzz/targets.py) runs in a process of its own, instrumented, starting from its
committed corpus (tests/fuzz/corpus/TARGET, seeded with valid inputs when empty). A finding (an
exception outside the decoder's contract, a refusal without a message, an input taking over 10 s)
stops that campaign and leaves the input as tests/fuzz/crashes/TARGET-* (once fixed, move it into
the corpus). The inputs that reached new code join the corpus, which the suite replays
(tests/test_fuzz_corpus.py); the figures go to docs/reliability.md.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CRASHES = Path(__file__).resolve().parent / "crashes"
DOC = ROOT / "docs" / "reliability.md"
START, END = "<!-- fuzz:start -->", "<!-- fuzz:end -->"
PER_INPUT_TIMEOUT_S = 10  # an input slower than this is a hang
MAX_LEN = 4096


def child(name: str, argv: list[str]) -> None:
    """One campaign, in this process (atheris ends it)."""
    import atheris

    with atheris.instrument_imports(include=["kvcr", "router_hints"]):
        from tests.fuzz.targets import TARGETS as instrumented
    target = instrumented[name]
    atheris.Setup([sys.argv[0], *argv], target.run)
    atheris.Fuzz()


def seed(name: str) -> Path:
    from tests.fuzz.targets import CORPUS, TARGETS
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.iterdir()):
        for i, data in enumerate(TARGETS[name].seeds()):
            (folder / f"seed-{i}").write_bytes(data)
    return folder


def campaign(name: str, seconds: int) -> dict:
    corpus = seed(name)
    CRASHES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"kvcr-fuzz-{name}-") as tmp:
        work = Path(tmp) / "work"
        shutil.copytree(corpus, work)
        t0 = time.monotonic()
        run = _libfuzzer(name, [str(work), f"-max_total_time={seconds}", f"-timeout={PER_INPUT_TIMEOUT_S}",
                                f"-max_len={MAX_LEN}", f"-artifact_prefix={CRASHES}/{name}-", "-print_final_stats=1"])
        elapsed = time.monotonic() - t0
        # libFuzzer names new inputs by their SHA-1: what the corpus lacks is what this run found
        # (its -merge re-executes argv[0], which under atheris is not the interpreter).
        new = [p for p in work.iterdir() if not (corpus / p.name).exists()]
        for path in new:
            shutil.copy(path, corpus / path.name)
        added = len(new)
    runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", run.stderr)
    findings = sorted(p.name for p in CRASHES.glob(f"{name}-*"))
    return {"target": name, "seconds": elapsed, "runs": int(runs[-1]) if runs else 0, "added": added,
            "corpus": sum(1 for _ in corpus.iterdir()), "rc": run.returncode, "findings": findings,
            "tail": run.stderr[-2000:]}


def _libfuzzer(name: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.fuzz.campaign", "--child", name, "--", *argv],
                          cwd=ROOT, capture_output=True, text=True)


def publish(results: list[dict], seconds: int) -> None:
    rows = "\n".join(f"| {r['target']} | {r['runs']:,} | {r['seconds']:.0f} | {r['corpus']} (+{r['added']}) | "
                     f"{len(r['findings'])} |" for r in results)
    section = (f"{START}\n`make fuzz` (`python -m tests.fuzz.campaign --seconds {seconds}`): atheris "
               f"(libFuzzer) over each decoder, instrumented, {PER_INPUT_TIMEOUT_S} s per input at most (a slower one "
               "is a hang). Findings: inputs that raised outside the decoder's contract, were refused without a "
               "message, or hung.\n\n| target | inputs run | seconds | corpus (added) | findings |\n"
               f"|---|---|---|---|---|\n{rows}\n{END}")
    text = DOC.read_text()
    if START in text:
        text = text[:text.index(START)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Fuzzing campaigns\n\n" + section + "\n"
    DOC.write_text(text)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # before kvcr is imported: instrumented
        child(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
        return 0
    from tests.fuzz.targets import TARGETS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=int, default=60, help="per target")
    parser.add_argument("--no-write", action="store_true", help="leave docs/reliability.md alone")
    parser.add_argument("targets", nargs="*", help=f"default: all of {', '.join(sorted(TARGETS))}")
    args = parser.parse_args()
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown target {unknown[0]!r} (known: {', '.join(sorted(TARGETS))})")
    names = args.targets or sorted(TARGETS)
    results = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name}: fuzzing for {args.seconds} s ...", flush=True)
        r = campaign(name, args.seconds)
        results.append(r)
        print(f"    {r['runs']:,} inputs, corpus {r['corpus']} (+{r['added']}), findings: {r['findings'] or 'none'}",
              flush=True)
        if r["findings"] or r["rc"]:
            print(r["tail"], file=sys.stderr)
    if not args.no_write:
        publish(results, args.seconds)
    return 1 if any(r["findings"] or r["rc"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

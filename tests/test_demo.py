"""`kvcr demo` end to end (the CI-sized variant), and its shutdown on Ctrl-C; the same on live
SGLang engines (`--engine sglang`, marked live_sglang)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wait_until

SMALL = ["--workers", "2", "--conversations", "4", "--turns", "3", "--layers", "2", "--hidden", "64", "--no-live"]
# `--engine sglang` in its CI size: 2 engines (and the reference), 12 requests
SGLANG_SMALL = ["--engine", "sglang", "--workers", "2", "--conversations", "4", "--turns", "3", "--no-live"]


def _have_sglang() -> bool:
    try:
        from importlib.metadata import version
        return version("sglang") == "0.5.23"
    except Exception:  # noqa: BLE001 - not installed
        return False


needs_sglang = pytest.mark.skipif(not _have_sglang(), reason="sglang 0.5.23 is not installed (make sglang-setup)")


def start_demo(run_dir: Path, *extra: str, size: list[str] = SMALL) -> tuple[subprocess.Popen, Path]:
    log = run_dir.parent / f"{run_dir.name}.stderr"
    # Ctrl-C as in a terminal, even when the test run itself was started in the background
    # (a shell's `cmd &` ignores SIGINT, and a child inherits that).
    proc = subprocess.Popen([sys.executable, "-m", "kvcr.cli", "demo", "--run-dir", str(run_dir), *size, *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def leftovers(run_dir: Path, log: Path) -> list[str]:
    """Processes started for this run, its temporary directory, and shared-memory regions of its children."""
    found = []
    tmp = re.search(r"NVMe in (\S+),", log.read_text())
    # SGLang engines name only the temporary directory (their model, state and NVMe) on their command line
    for pattern in (str(run_dir), *([tmp.group(1)] if tmp else [])):
        ps = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
        found += [f"process {pid}" for pid in ps]
    if tmp and Path(tmp.group(1)).exists():
        found.append(f"temporary directory {tmp.group(1)}")
    for info in (run_dir / "logs").glob("w*.info.json"):
        shm = json.loads(info.read_text())["kvcr_runner"]["shm_path"]
        if os.path.exists(shm):
            found.append(f"region {shm}")
    return found


@pytest.mark.parametrize("router", ["kvcr", pytest.param("dynamo", marks=pytest.mark.dynamo_frontend)])
def test_the_small_demo_pulls_from_peers_and_every_cached_answer_matches_the_oracle(tmp_path, router):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir, "--router", router)
    assert proc.wait(300) == 0, log.read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ok"] and not summary["errors"] and summary["problems"] == []
    assert summary["peer_hits"] > 0 and summary["page_sources"]["dram"] > 0
    assert summary["oracle"]["checks"] > 0 and summary["oracle"]["mismatches"] == 0
    assert summary["oracle"]["chunked_bitwise_equal"] == summary["oracle"]["checks"]
    assert summary["oracle"]["max_abs_vs_one_shot"] <= 1e-4
    assert (run_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "demo OK" in log.read_text()
    assert summary["router"] == router
    if router == "dynamo":  # Dynamo's router placed every request; its hints drove the pulls
        assert summary["dynamo_hints"] > 0 and "Dynamo's KV router decided every request" in log.read_text()
    assert leftovers(run_dir, log) == []


@pytest.mark.parametrize("moment", ["[3/4] workload", "holding"])
def test_ctrl_c_stops_everything_within_ten_seconds(tmp_path, moment):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir, "--hold")
    wait_until(lambda: moment in log.read_text() or proc.poll() is not None, 240, 0.05, moment)
    assert proc.poll() is None, log.read_text()
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(10)
    assert time.monotonic() - start < 10
    assert rc == (0 if moment == "holding" else 130), log.read_text()
    assert leftovers(run_dir, log) == []


@pytest.mark.parametrize("found", [None, "0.5.22"])
def test_the_sglang_variant_without_sglang_0_5_23_names_make_sglang_setup(tmp_path, monkeypatch, capsys, found):
    from kvcr import cli
    from sglang_adapter import demo

    monkeypatch.setattr(demo, "installed_sglang", lambda: found)
    assert cli.main(["demo", "--engine", "sglang", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "make sglang-setup" in err and "0.5.23" in err and (found or "not installed") in err
    assert not (tmp_path / "run").exists()  # refused before anything started


def _answer(chosen: list[float], ids: list[int], top: int = 5) -> tuple[dict, list[int]]:
    """An SGLang /generate meta_info (chosen and top logprobs per output position) and its ids."""
    tops = [[[lp - 0.5 * rank, 100 + rank] for rank in range(top)] for lp in chosen]
    return {"output_token_logprobs": [[lp, tok, None] for lp, tok in zip(chosen, ids)],
            "output_top_logprobs": tops}, ids


COLD = [-1.78, -2.00, -0.70, -1.40]


@pytest.mark.parametrize("chosen, ids, top, ok", [
    (COLD, [5, 6, 7, 8], 5, True),                                    # bitwise
    ([-1.78, -2.00 + 1 / 32, -0.70, -1.40], [5, 6, 7, 8], 5, True),  # one bf16 step of a logit near 8
    ([-1.78, -2.00 + 1 / 16, -0.70, -1.40], [5, 6, 7, 8], 5, True),  # one step of a logit up to 16
    ([-1.78, -2.00, -0.70 - 0.5, -1.40], [5, 6, 7, 8], 5, False),    # what a changed prompt token does
    (COLD, [5, 6, 9, 8], 5, False),                                   # another output token
    (COLD, [5, 6, 7, 8], 4, False),                                   # fewer top logprobs than asked
])
def test_the_sglang_oracle_allows_a_rounding_step_and_refuses_a_changed_answer(chosen, ids, top, ok):
    from kvcr.demo.sglang_driver import compare

    cold_meta, cold_ids = _answer(COLD, [5, 6, 7, 8])
    meta, output_ids = _answer(chosen, ids, top)
    verdict = compare(meta, output_ids, {"output_ids": cold_ids, "meta_info": cold_meta})
    assert verdict["ok"] is ok
    assert verdict["bitwise_equal"] is (chosen == COLD and ids == cold_ids and top == 5)


@pytest.mark.live_sglang
@needs_sglang
@pytest.mark.timeout(600)
def test_the_small_sglang_demo_pulls_from_peers_and_every_cached_answer_matches_a_cold_run(tmp_path):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir, size=SGLANG_SMALL)
    assert proc.wait(540) == 0, log.read_text()[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "sglang" and summary["ok"], summary["problems"]
    assert not summary["errors"] and summary["problems"] == []
    oracle = summary["oracle"]
    assert oracle["checks"] > 0 and oracle["mismatches"] == 0
    assert oracle["output_ids_equal"] == oracle["checks"] and oracle["max_abs_logprob"] <= oracle["tolerance"]
    assert oracle["control"]["detected"], "the oracle could not tell a changed prompt token apart"
    assert oracle["prompt_ids_checked"] == summary["requests"] and oracle["prompt_ids_mismatches"] == 0
    # pages pulled from a peer: per answer (SGLang's storage hits, split by the runner's counters) and by the runners
    assert summary["peer_hits"] > 0 and summary["phases"]["share"]["peer"] > 0
    assert summary["phases"]["migrate"]["peer"] > 0
    assert sum(w["runner_pulled_pages"] for w in summary["workers"].values()) >= summary["peer_hits"]
    assert summary["page_sources"]["device"] > 0  # follow-ups stay where their prefix is
    assert all(o["source"] for o in summary["outcomes"] if o["peer_pages"])
    assert (run_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "demo OK" in log.read_text()
    assert leftovers(run_dir, log) == []


@pytest.mark.live_sglang
@needs_sglang
@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_sglang_demo_within_ten_seconds(tmp_path):
    run_dir = tmp_path / "run"
    proc, log = start_demo(run_dir, "--hold", size=SGLANG_SMALL)
    wait_until(lambda: "[3/4] workload" in log.read_text() or proc.poll() is not None, 480, 0.05, "the workload")
    assert proc.poll() is None, log.read_text()[-6000:]
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(10)
    assert time.monotonic() - start < 10
    assert rc == 130, log.read_text()[-6000:]
    assert leftovers(run_dir, log) == []

"""What live SGLang tests import besides fixtures: a metric from Prometheus text, a `kvcr router`
in front of live engines."""

from __future__ import annotations

from pathlib import Path


def kvcr_router(tmp: Path, tokenizer: Path, workers: list[dict], **router_keys):
    """A started, ready `kvcr router` in front of live engines (`workers`: its [[workers]] entries)."""
    import json

    from kvcr.demo.procs import Child

    config = tmp / "router.json"
    config.write_text(json.dumps({"router": {"port": 0, "block_size": 16, "tokenizer": str(tokenizer), **router_keys},
                                  "workers": workers}))
    front = Child(tmp, "router", ["router", "--config", str(config)]).start()
    try:
        front.wait_ready(120)
    except BaseException:
        front.stop()
        raise
    return front


def metric(text: str, name: str, **labels: str) -> float:
    """A value from Prometheus text: the sum over the samples carrying `labels` (which must exist)."""
    from kvcr.demo.sglang_driver import metric as summed

    assert any(line.startswith(name) for line in text.splitlines()), f"metric {name} missing"
    return summed(text, name, **labels)


def followed_blocks(text: str, peer: str) -> float:
    """Blocks a runner's feed (its Prometheus `text`) knows `peer` to hold: 0 until it follows the
    peer at all (the peers directory is scanned every 2 s), where `metric` would fail at once."""
    from kvcr.demo.sglang_driver import metric as summed

    return summed(text, "kvcr_peer_feed_blocks", peer=peer)


# DP attention over two ranks (a DeepSeek-V2: SGLang's Llama has no DP-attention path)
DP_ATTENTION = ["--tp", "2", "--dp-size", "2", "--enable-dp-attention", "--hicache-storage-prefetch-policy",
                "wait_complete", "--enable-cache-report"]


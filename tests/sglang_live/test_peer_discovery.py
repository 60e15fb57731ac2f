"""Live: two engines a user starts on one host with kvcr's defaults find each other through the
user's peers directory, and one serves the other's prefix with no router, no hint and no list;
an engine that crashes leaves the directory and its peer stops following it. The same through
etcd (`peers_etcd`), as engines on several hosts find each other."""

from __future__ import annotations

import signal

import pytest

from sglang_adapter.cpu_harness.model import prompt_text
from tests.helpers import wait_until
from tests.sglang_live.helpers import followed_blocks, metric

pytestmark = pytest.mark.live_sglang
PAGE = 16
WAIT = ["--hicache-storage-prefetch-policy", "wait_complete"]


@pytest.fixture(scope="module")
def found(engines, tmp_path_factory):
    """Both engines on the backend's default peers_dir ("auto": under the user's XDG_RUNTIME_DIR)."""
    runtime = tmp_path_factory.mktemp("runtime")
    a, b = engines("found-A", "found-B", args=WAIT, peers_dir=None, env={"XDG_RUNTIME_DIR": str(runtime)})
    return a, b, runtime / "kvcr" / "peers"


def _feed(server) -> str:
    return server.runner_get("/metrics")


def test_an_engine_serves_its_neighbours_prefix_found_with_kvcrs_defaults(found, live):
    a, b, directory = found
    assert len(list(directory.glob("*.json"))) == 2
    text = prompt_text(210, 500)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: followed_blocks(_feed(b), a.endpoints["control"]) >= full,
               timeout_s=30, message="B follows A's stream and knows its pages")
    pulled = live.generate(b, text)  # no kv_hints, no router: B looks the pages up among its peers
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert pulled["output_ids"] == first["output_ids"]
    assert live.logprobs(pulled) == live.logprobs(first)
    wait_until(lambda: metric(a.runner_get("/metrics"), "kvcr_claims_held") == 0, timeout_s=10,
               message="A's claims released")
    assert metric(b.runner_get("/metrics"), "kvcr_pulled_pages_total") >= full


def test_a_crashed_engine_leaves_the_directory_and_is_no_longer_followed(found):
    a, b, directory = found
    a.stop(signal.SIGKILL)  # no exit handler runs: B's scan finds the process gone
    wait_until(lambda: f'peer="{a.endpoints["control"]}"' not in _feed(b), timeout_s=30,
               message="B stopped following A")
    assert len(list(directory.glob("*.json"))) == 1


def test_a_restarted_engine_serves_its_first_request_from_the_neighbours_pages(found, live):
    """After a restart the engine holds nothing: its first request for a prefix its neighbour holds is
    pulled, not recomputed (runs after the crash above)."""
    a, b, directory = found
    text = prompt_text(230, 500)
    first = live.serve(b, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    a.start().wait_ready()
    wait_until(lambda: followed_blocks(_feed(a), b.endpoints["control"]) >= full,
               timeout_s=30, message="the restarted A follows B again")
    again = live.generate(a, text)
    assert again["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert live.logprobs(again) == live.logprobs(first)
    assert len(list(directory.glob("*.json"))) == 2


def test_engines_registered_in_etcd_serve_each_others_prefix_and_a_killed_one_leaves_with_its_lease(
        engines, etcd, live):
    a, b = engines("etcd-A", "etcd-B", args=WAIT, extra_config={"peers_etcd": etcd.endpoint})
    text = prompt_text(250, 500)
    first = live.serve(a, text)
    full = first["meta_info"]["prompt_tokens"] // PAGE
    wait_until(lambda: followed_blocks(_feed(b), a.endpoints["control"]) >= full,
               timeout_s=30, message="B found A in etcd and follows its stream")
    pulled = live.generate(b, text)  # no hint, no router, no list, no shared directory
    assert pulled["meta_info"]["cached_tokens_details"]["storage"] == full * PAGE
    assert live.logprobs(pulled) == live.logprobs(first)
    a.stop(signal.SIGKILL)  # nothing revokes its lease: the entry ends with it (10 s)
    wait_until(lambda: f'peer="{a.endpoints["control"]}"' not in _feed(b), timeout_s=45,
               message="B stopped following A once A's lease ended")

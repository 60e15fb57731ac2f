"""The router's measured costs: seconds per block fitted from first-byte times, and the tier
weights a worker is scored with once measured."""

import random

import pytest

from router_hints.core import Route
from router_hints.index import Overlap
from router_hints.rates import KINDS, Rates, RateSettings, Sample, WorkerRates, solve, tier_weights
from router_hints.scoring import Choice, CostModel, Load, choose, pullable_blocks

pytestmark = pytest.mark.pure

W = ("w", 0)
TRUE = {"computed": 2e-3, "device": 2e-4, "host": 1e-3, "dram": 1.2e-3, "disk": 1.8e-3, "pulled": 1.5e-3}


def synthetic(rng: random.Random, rates: dict[str, float], base_s: float = 0.01, noise: float = 0.0) -> Sample:
    blocks = {k: rng.choice([0, 0, rng.randint(1, 60)]) for k in KINDS}
    blocks["computed"] = rng.randint(1, 80)
    seconds = base_s + sum(rates[k] * n for k, n in blocks.items()) + rng.uniform(-noise, noise)
    return Sample(seconds=max(0.0, seconds), **blocks)


@pytest.fixture
def rng():
    return random.Random(7)


def test_the_fit_recovers_each_kinds_seconds_per_block(rng):
    rates = WorkerRates(RateSettings())
    for _ in range(200):
        rates.add(synthetic(rng, TRUE, noise=1e-3))
    for kind, want in TRUE.items():
        assert rates.seconds_per_block[kind] == pytest.approx(want, abs=1e-4), kind


def test_a_tiers_weight_is_the_share_of_a_recompute_its_block_saves(rng):
    r = Rates(CostModel())
    for _ in range(120):
        r.add(W, synthetic(rng, TRUE))
    weights = tier_weights(r.model(W))
    assert weights == pytest.approx({"device": 0.9, "host": 0.5, "dram": 0.4, "disk": 0.1, "pulled": 0.25}, abs=1e-6)


@pytest.mark.parametrize("pulled_s, weight", [(3e-3, 0.0), (0.0, 1.0)])
def test_a_weight_stays_within_nothing_saved_and_all_saved(rng, pulled_s, weight):
    r = Rates(CostModel())
    for _ in range(120):
        r.add(W, synthetic(rng, {**TRUE, "pulled": pulled_s}))
    assert r.model(W).peer_pull_weight == pytest.approx(weight, abs=1e-6)


def test_configured_weights_stand_until_enough_samples_and_for_tiers_never_seen(rng):
    base = CostModel(disk_cache_hit_weight=0.3)
    r = Rates(base, RateSettings(min_samples=32))
    for _ in range(31):
        r.add(W, synthetic(rng, TRUE))
    assert r.model(W) == base and r.model(("other", 0)) == base
    no_disk = {**TRUE, "disk": 0.0}
    for _ in range(60):
        s = synthetic(rng, no_disk)
        r.add(W, Sample(s.computed, s.device, s.host, s.dram, 0, s.pulled, s.seconds))
    assert r.model(W).disk_cache_hit_weight == 0.3  # no sample had disk blocks
    assert r.model(W).host_cache_hit_weight == pytest.approx(0.5, abs=1e-6)


def test_the_fit_follows_a_worker_whose_rates_change(rng):
    r = Rates(CostModel(), RateSettings(window=64))
    for _ in range(200):
        r.add(W, synthetic(rng, TRUE))
    slower_host = {**TRUE, "host": 1.8e-3}
    for _ in range(600):
        r.add(W, synthetic(rng, slower_host))
    assert r.model(W).host_cache_hit_weight == pytest.approx(0.1, abs=0.02)


def test_a_forgotten_worker_is_scored_with_the_configured_weights_again(rng):
    r = Rates(CostModel())
    for _ in range(64):
        r.add(W, synthetic(rng, TRUE))
    assert r.model(W) != r.base
    r.forget(W)
    assert r.model(W) == r.base


def test_a_sample_with_negative_blocks_or_time_is_refused():
    with pytest.raises(ValueError, match="no negative"):
        Sample(1, 0, 0, 0, 0, -1, 0.1)
    with pytest.raises(ValueError, match="no negative"):
        Sample(1, 0, 0, 0, 0, 0, -0.1)


def test_a_term_never_seen_fits_zero_and_leaves_the_others_exact():
    assert solve([[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0]) == [0.0, 0.0]
    assert solve([[4.0, 0.0], [0.0, 0.0]], [2.0, 0.0]) == pytest.approx([0.5, 0.0])


def test_a_route_measures_its_targets_blocks_by_kind():
    overlap = Overlap(device=3, host=2, dram=1, disk=0, runner=1)
    choice = Choice(W, 0.0, overlap, {W: 0.0})
    route = Route(choice, {"actions": []}, request_blocks=20, overlaps={W: overlap},
                  loads={W: Load(active_prefill_blocks=7)}, hint_blocks=10)
    assert route.sample(0.25, hinted=True) == Sample(computed=10 + 7, device=3, host=2, dram=1, disk=0, pulled=4,
                                                     seconds=0.25)
    # a hint that never reached the worker pulled nothing: those blocks were computed
    assert route.sample(0.25, hinted=False) == Sample(computed=14 + 7, device=3, host=2, dram=1, disk=0, pulled=0,
                                                      seconds=0.25)


def test_a_candidate_a_peer_can_feed_is_credited_its_pullable_blocks_at_the_pull_weight():
    holder, idle, other_role, plain = ("h", 0), ("i", 0), ("p", 0), ("s", 0)
    overlaps = {holder: Overlap(device=10, runner=10), other_role: Overlap(runner=16)}
    endpoints = {holder: "tcp://h", idle: "tcp://i", other_role: "tcp://p"}
    roles = {other_role: "prefill"}
    pullable = pullable_blocks([holder, idle, plain], overlaps, endpoints, roles)
    # the prefill-role peer is no source for either; a worker with no runner cannot take a hint
    assert pullable == {holder: 0, idle: 10, plain: 0}
    pullable.pop(plain)
    loads = {holder: Load(active_prefill_blocks=8)}
    without = choose(CostModel(), [holder, idle], overlaps, loads, 12, 16, pullable=pullable)
    assert without.worker == holder and without.costs[idle] == 12
    models = {idle: CostModel(peer_pull_weight=0.9)}
    with_pull = choose(CostModel(), [holder, idle], overlaps, loads, 12, 16, models=models, pullable=pullable)
    assert with_pull.worker == idle and with_pull.costs[idle] == pytest.approx(3.0)


def test_a_few_requests_stalled_by_something_else_barely_move_the_weights(rng):
    r = Rates(CostModel())
    for _ in range(200):
        r.add(W, synthetic(rng, TRUE, noise=2e-3))
    for i in range(200):
        s = synthetic(rng, TRUE, noise=2e-3)
        stall = 2.0 if i % 10 == 0 else 0.0
        r.add(W, Sample(s.computed, s.device, s.host, s.dram, s.disk, s.pulled, s.seconds + stall))
    weights = tier_weights(r.model(W))
    assert weights == pytest.approx({"device": 0.9, "host": 0.5, "dram": 0.4, "disk": 0.1, "pulled": 0.25}, abs=0.05)


def test_weights_the_samples_cannot_pin_down_stay_as_configured(rng):
    """Every request computing the same 3 blocks cannot tell a computed block's cost from the fixed
    part, and noise swamping the blocks' costs leaves every weight unknown."""
    same_work = Rates(CostModel())
    for _ in range(300):
        device = rng.randint(0, 100)
        seconds = 0.01 + 3 * TRUE["computed"] + TRUE["device"] * device + TRUE["host"] * (100 - device)
        same_work.add(W, Sample(3, device, 100 - device, 0, 0, 0, seconds + rng.uniform(-1e-3, 1e-3)))
    assert same_work.model(W) == same_work.base
    noisy = Rates(CostModel())
    for _ in range(100):
        noisy.add(W, synthetic(rng, TRUE, noise=0.5))
    assert noisy.model(W) == noisy.base


def test_the_first_fit_sets_how_far_later_samples_may_stray(rng):
    """Moderate noise and no stalls: the clip (3 mean residuals, from the first fit on) leaves the
    noise as it is, so the standard errors the weights are admitted by stay honest."""
    rates = WorkerRates(RateSettings())
    for _ in range(64):
        rates.add(synthetic(rng, TRUE, noise=0.02))
    first = rates.spread
    assert first == pytest.approx(0.8 * 0.02 / 3 ** 0.5, rel=0.35)  # uniform noise: sd = width / sqrt 3
    for _ in range(400):
        rates.add(synthetic(rng, TRUE, noise=0.02))
    assert rates.spread == pytest.approx(0.02 / 2, rel=0.25)  # mean |uniform(-w, w)| = w / 2


def test_a_core_that_does_not_measure_scores_with_the_configured_weights_and_takes_no_samples(rng):
    from router_hints.core import RouterCore

    core = RouterCore(block_size=16, measure_costs=False)
    overlap = Overlap(device=3)
    route = Route(Choice(W, 0.0, overlap, {W: 0.0}), None, request_blocks=10, overlaps={W: overlap})
    core.measured(route, 0.1, hinted=False)
    assert core.rates.workers == {} and core.model_of(W) == core.model

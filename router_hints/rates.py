"""What a block costs a worker, measured from the requests the router sends it. Pure: samples are passed in.

Each streamed request gives one sample: the seconds to its first byte and, as the router scored
it, how many blocks the worker had to compute (its own new blocks and the prefill booked ahead
of it) and how many it had at each tier (on device, in the engine's host pool, in its runner's
DRAM or disk, pulled from the hinted peer). A decayed least-squares fit gives seconds per block
of each kind; a tier's weight in the cost model is the share of a recompute that holding a block
there saves, `1 - seconds_per_tier_block / seconds_per_computed_block`, kept in [0, 1]. Until a
kind has enough samples its configured weight stands, so a deployment's own figures rule until
the run has measured its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from .index import Worker
from .scoring import CostModel

KINDS = ("computed", "device", "host", "dram", "disk", "pulled")  # the fit's terms, after its intercept
CLIP = 3.0  # residuals beyond this many mean absolute residuals are cut to it
WEIGHT_OF = {"device": "overlap_score_credit", "host": "host_cache_hit_weight", "dram": "runner_dram_hit_weight",
             "disk": "disk_cache_hit_weight", "pulled": "peer_pull_weight"}


def tier_weights(model: CostModel) -> dict[str, float]:
    values = asdict(model)
    return {tier: values[name] for tier, name in WEIGHT_OF.items()}


@dataclass(frozen=True, slots=True)
class Sample:
    computed: int   # blocks computed: the request's new blocks and those booked ahead of it
    device: int
    host: int
    dram: int
    disk: int
    pulled: int     # blocks the hint named beyond what the worker held
    seconds: float  # to the first byte

    def __post_init__(self) -> None:
        if min(self.computed, self.device, self.host, self.dram, self.disk, self.pulled) < 0 or self.seconds < 0:
            raise ValueError(f"a sample counts no negative blocks or time: {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RateSettings:
    window: int = 256       # samples: older ones weigh e^-1 after this many more
    min_samples: int = 64   # samples of a worker before any weight is measured
    min_tier_samples: int = 8  # samples with blocks at a tier before that tier's weight is measured
    refit_every: int = 8    # samples between refits (a fit is a small solve, not free on every request)
    max_weight_sd: float = 0.1  # a tier's measured weight stands only when known this well (its standard error)
    max_compute_rel_sd: float = 0.25  # nor any while a computed block's cost is known no better than this, relative


@dataclass
class WorkerRates:
    """One worker's decayed normal equations over [1, *KINDS] and its latest fit."""

    settings: RateSettings
    xtx: list[list[float]] = field(default_factory=lambda: [[0.0] * (len(KINDS) + 1) for _ in range(len(KINDS) + 1)])
    xty: list[float] = field(default_factory=lambda: [0.0] * (len(KINDS) + 1))
    seen: list[float] = field(default_factory=lambda: [0.0] * (len(KINDS) + 1))  # decayed samples with the term > 0
    yy: float = 0.0
    samples: int = 0
    theta: list[float] = field(default_factory=list)  # the latest fit, intercept first; empty until min_samples
    covariance: list[list[float]] = field(default_factory=list)  # the fit's, from its residuals
    measured: dict[str, float] = field(default_factory=dict)  # the weights the latest fit pins down
    spread: float = 0.0  # decayed mean absolute residual against the fit

    @property
    def seconds_per_block(self) -> dict[str, float]:
        return dict(zip(KINDS, self.theta[1:]))

    def add(self, s: Sample) -> None:
        keep = 1.0 - 1.0 / self.settings.window
        x = [1.0, s.computed, s.device, s.host, s.dram, s.disk, s.pulled]
        y = s.seconds
        if self.theta:
            # A request stalled by something else on the machine says little of its blocks: its
            # residual counts at most CLIP times the usual one.
            expected = sum(t * xi for t, xi in zip(self.theta, x))
            bound = CLIP * max(self.spread, 0.05 * abs(expected))  # a noiseless worker can still change
            residual = max(-bound, min(bound, y - expected))
            self.spread = keep * self.spread + (1 - keep) * abs(residual)
            y = expected + residual
        self.yy = keep * self.yy + y * y
        for i, xi in enumerate(x):
            self.xty[i] = keep * self.xty[i] + xi * y
            self.seen[i] = keep * self.seen[i] + (xi > 0)
            row = self.xtx[i]
            for j, xj in enumerate(x):
                row[j] = keep * row[j] + xi * xj
        self.samples += 1
        if self.samples >= self.settings.min_samples and self.samples % self.settings.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        n = len(self.xty)
        self.theta = solve(self.xtx, self.xty)
        # Residual variance over the decayed samples, and the fit's covariance from it: a term the
        # samples cannot tell from the others (collinear, or buried in noise) shows a wide spread.
        rss = self.yy - 2 * sum(t * b for t, b in zip(self.theta, self.xty)) + sum(
            self.theta[i] * self.xtx[i][j] * self.theta[j] for i in range(n) for j in range(n))
        # Decayed weights with sum(w) - p degrees of freedom: on the cautious side (about sqrt 2 wide).
        variance = max(rss, 0.0) / max(1.0, self.xtx[0][0] - n)
        if not self.spread:  # the first fit: residuals are clipped from here on, at about 2.4 sigma
            self.spread = 0.8 * variance ** 0.5
        inverse = [solve(self.xtx, [float(i == j) for i in range(n)]) for j in range(n)]
        self.covariance = [[variance * inverse[j][i] for j in range(n)] for i in range(n)]
        self.measured = self._weights()

    def _weights(self) -> dict[str, float]:
        """The measured weight of each tier touched by enough samples and known well enough; none
        while computing a block is not measured to cost time."""
        if self.seen[1] < self.settings.min_tier_samples:
            return {}
        compute, cov = self.theta[1], self.covariance
        if compute <= 0 or max(0.0, cov[1][1]) ** 0.5 > self.settings.max_compute_rel_sd * compute:
            return {}
        out = {}
        for i, kind in enumerate(KINDS[1:], start=2):
            if self.seen[i] < self.settings.min_tier_samples:
                continue
            ratio = self.theta[i] / compute
            # the standard error of 1 - b/a (first order in the fit's errors)
            sd = max(0.0, cov[i][i] + ratio * ratio * cov[1][1] - 2 * ratio * cov[i][1]) ** 0.5 / compute
            if sd <= self.settings.max_weight_sd:
                out[kind] = min(1.0, max(0.0, 1.0 - ratio))
        return out


def solve(a: list[list[float]], b: list[float]) -> list[float]:
    """The least-squares solution of the normal equations `a x = b` (symmetric, positive
    semidefinite); a little ridge keeps a term that never varied (all zero) at zero."""
    n = len(b)
    ridge = 1e-9 * max(1.0, max(a[i][i] for i in range(n)))
    m = [[a[i][j] + (ridge if i == j else 0.0) for j in range(n)] + [b[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [v - f * w for v, w in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class Rates:
    """Every worker's rates, and the cost model each is scored with (the configured one where a
    tier is not yet measured)."""

    base: CostModel
    settings: RateSettings = field(default_factory=RateSettings)
    workers: dict[Worker, WorkerRates] = field(default_factory=dict)
    _models: dict[Worker, CostModel] = field(default_factory=dict)  # asked per candidate per request: kept

    def add(self, worker: Worker, sample: Sample) -> None:
        rates = self.workers.setdefault(worker, WorkerRates(self.settings))
        before = rates.measured
        rates.add(sample)
        if rates.measured != before:
            self._models[worker] = replace(self.base, **{WEIGHT_OF[k]: w for k, w in rates.measured.items()})

    def forget(self, worker: Worker) -> None:
        self.workers.pop(worker, None)
        self._models.pop(worker, None)

    def model(self, worker: Worker) -> CostModel:
        return self._models.get(worker, self.base)

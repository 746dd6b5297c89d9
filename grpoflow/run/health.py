"""Health checks that act: each step's metrics are checked for the failures runs lose days to, and
a check that fires warns or stops the run (after a checkpoint, naming the last good one).

Checks (`CHECKS`), each with an action `health_NAME`: warn, stop or off:

- `nonfinite`: NaN or infinity in the loss, the gradient norm, the mean reward or, after the
  update, the weights (stop: a diverged policy would otherwise go on to sample garbage);
- `kl_spike`: the KL jumps above `kl_spike_factor` times its median over the previous
  `health_window` steps (and above `kl_spike_min`);
- `logprob_gap`: the engine's log-probs of its samples differ from the trainer's by more than
  `logprob_gap_max` nats per token on average, or, under `on_policy_check: update`, by any bit in
  some completion (`on_policy/unverified_fraction` above 0);
- `distribution_gap`: at some checked position the engine's whole next-token distribution is
  more than `distribution_tv_max` in total variation from the trainer's
  (`sampling/distribution_tv/max`);
- `reward_errors`: reward functions fail on more than `reward_error_rate` of the samples;
- `zero_spread`, `entropy_collapse`, `length_growth`: over the last `health_window` steps, at least
  `zero_spread_fraction` of the groups have no reward spread; the entropy fell below
  `entropy_collapse_ratio` times its mean over the run's first window; the mean completion length
  grew `length_growth_factor`-fold with most completions truncated. These three only fire while
  the reward has not risen above its first window's mean: a solved task also stops exploring and
  gives every group the same reward, and that is no failure.

Window checks fire once their condition has held for `health_window` steps in a row; every check
warns once per streak.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from grpoflow.options import require

logger = logging.getLogger("grpoflow")

Action = Literal["warn", "stop", "off"]


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """Which checks run, their thresholds, and what each does when it fires."""

    health_nonfinite: Action = "stop"
    """NaN or infinity in the loss, gradient norm or mean reward."""
    health_kl_spike: Action = "warn"
    """The KL jumps far above its recent median."""
    health_logprob_gap: Action = "warn"
    """The engine's log-probs drift from the trainer's."""
    health_distribution_gap: Action = "warn"
    """The engine's next-token distribution differs from the trainer's at a checked position."""
    health_reward_errors: Action = "warn"
    """Reward functions fail on many samples."""
    health_zero_spread: Action = "warn"
    """Nearly every group has the same reward for every completion (no learning signal)."""
    health_entropy_collapse: Action = "warn"
    """The policy's entropy collapses while the reward does not rise."""
    health_length_growth: Action = "warn"
    """Completion lengths grow into the limit while the reward does not rise."""
    health_window: int = 20
    """Steps of the baselines and of the streak a window check needs."""
    kl_spike_factor: float = 10.0
    """kl_spike fires above this many times the recent median KL."""
    kl_spike_min: float = 0.05
    """... and above this KL."""
    logprob_gap_max: float = 1.0
    """logprob_gap fires above this mean gap (nats per token)."""
    distribution_tv_max: float = 0.1
    """distribution_gap fires above this total variation distance."""
    reward_error_rate: float = 0.5
    """reward_errors fires above this share of failed samples."""
    zero_spread_fraction: float = 0.95
    """zero_spread fires when at least this share of groups have no reward spread."""
    entropy_collapse_ratio: float = 0.1
    """entropy_collapse fires below this fraction of the first window's entropy."""
    length_growth_factor: float = 3.0
    """length_growth fires at this multiple of the first window's mean length."""

    def __post_init__(self) -> None:
        require(self.health_window >= 2, "health_window", ">= 2", self.health_window)
        for name in ("kl_spike_factor", "length_growth_factor"):
            require(getattr(self, name) > 1, name, "> 1", getattr(self, name))
        for name in (
            "reward_error_rate",
            "zero_spread_fraction",
            "entropy_collapse_ratio",
            "distribution_tv_max",
        ):
            require(0 < getattr(self, name) <= 1, name, "in (0, 1]", getattr(self, name))
        for name in ("kl_spike_min", "logprob_gap_max"):
            require(getattr(self, name) > 0, name, "> 0", getattr(self, name))


@dataclass(slots=True)
class Finding:
    """A check that fired: what it saw, and since which step."""

    check: str
    step: int
    since: int
    """The first step of the streak (the last good state is before it)."""
    message: str
    action: Action


@dataclass
class History:
    """The metrics the checks read, per step, with the run's first window kept as baselines."""

    window: int
    recent: deque = field(init=False)
    first: list[Mapping[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window + 1)

    def add(self, metrics: Mapping[str, float]) -> None:
        self.recent.append(metrics)
        if len(self.first) < self.window:
            self.first.append(metrics)

    def baseline(self, key: str) -> float | None:
        """The mean of `key` over the run's first window, once it is full."""
        values = [m[key] for m in self.first if _finite(m.get(key))]
        return statistics.fmean(values) if len(self.first) == self.window and values else None

    def previous(self, key: str) -> list[float]:
        """`key` over the window before the latest step."""
        return [m[key] for m in list(self.recent)[:-1] if _finite(m.get(key))]

    def last(self, key: str) -> list[float]:
        """`key` over the latest window (the latest step included)."""
        return [m[key] for m in list(self.recent)[-self.window :] if _finite(m.get(key))]

    def stalled(self) -> bool:
        """The reward over the latest window is not above its first window's mean."""
        first, latest = self.baseline("reward"), self.last("reward")
        if first is None or len(latest) < self.window:
            return False
        return statistics.fmean(latest) <= first + 0.01 * abs(first) + 1e-6


Check = Callable[[Mapping[str, float], History, HealthConfig], str | None]
"""The latest metrics, the history (the latest included), the settings -> what is wrong, or None."""


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _nonfinite(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    bad = [
        key for key in ("loss", "grad_norm", "reward") if key in metrics and not math.isfinite(metrics[key])
    ]
    if metrics.get("weights/nonfinite", 0.0) > 0:
        bad.append("weights/nonfinite")
    if not bad:
        return None
    found = ", ".join(f"{key} = {metrics[key]}" for key in bad)
    return f"{found}: the update diverged (lower learning_rate, or check the rewards for huge values)"


def _kl_spike(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    kl, before = metrics.get("kl"), history.previous("kl")
    if not _finite(kl) or len(before) < config.health_window:
        return None
    median = statistics.median(before)
    if kl > config.kl_spike_min and kl > config.kl_spike_factor * median:
        return f"kl = {kl:.4g}, {kl / max(median, 1e-12):.0f}x its median {median:.3g} over the previous {len(before)} steps"
    return None


def _logprob_gap(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    unverified = metrics.get("on_policy/unverified_fraction")
    if _finite(unverified) and unverified > 0:
        return (
            f"{unverified:.1%} of the completions had a token whose engine log-prob differs from the "
            "trainer's and were left out of the loss: the engine no longer computes the trainer's "
            "logits (weights not synced, or kernels outside the batch-invariant set); set "
            "on_policy_check: replay to redraw instead"
        )
    gap = metrics.get("sampling/sampling_logp_difference/mean")
    if _finite(gap) and gap > config.logprob_gap_max:
        return (
            f"the engine's log-probs differ from the trainer's by {gap:.3g} nats per token "
            f"(> {config.logprob_gap_max}): stale or mismatched engine weights, or another model"
        )
    return None


def _distribution_gap(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    tv = metrics.get("sampling/distribution_tv/max")
    if _finite(tv) and tv > config.distribution_tv_max:
        return (
            f"the engine's next-token distribution is {tv:.3g} in total variation from the trainer's at "
            f"a checked position (> {config.distribution_tv_max}): weights not synced to the engine, a "
            "different dtype, or another attention implementation"
        )
    return None


def _reward_errors(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    rate = metrics.get("rewards/failed_fraction")
    if _finite(rate):  # a failed episode has no reward: not the reward functions' failure
        rate -= metrics.get("episodes/failed_fraction", 0.0)
    if _finite(rate) and rate > config.reward_error_rate:
        return f"reward functions failed on {rate:.0%} of the samples (the warnings above name them)"
    return None


def _zero_spread(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    shares = history.last("frac_reward_zero_std")
    if (
        len(shares) < config.health_window
        or min(shares) < config.zero_spread_fraction
        or not history.stalled()
    ):
        return None
    return (
        f"at least {config.zero_spread_fraction:.0%} of the groups had no reward spread for {len(shares)} steps "
        "and the reward is not rising: no learning signal (the task may be too hard or the reward broken)"
    )


def _entropy_collapse(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    first, latest = history.baseline("entropy"), history.last("entropy")
    if first is None or len(latest) < config.health_window or not history.stalled():
        return None
    limit = config.entropy_collapse_ratio * first
    if max(latest) < limit:
        return f"entropy {latest[-1]:.3g} stayed below {limit:.3g} ({config.entropy_collapse_ratio:.0%} of its start) while the reward did not rise"
    return None


def _length_growth(metrics: Mapping[str, float], history: History, config: HealthConfig) -> str | None:
    first, latest = history.baseline("completions/mean_length"), history.last("completions/mean_length")
    clipped = history.last("completions/clipped_ratio")
    if first is None or len(latest) < config.health_window or not history.stalled():
        return None
    if min(latest) > config.length_growth_factor * first and clipped and statistics.fmean(clipped) > 0.5:
        return (
            f"mean completion length {latest[-1]:.0f} is over {config.length_growth_factor:g}x its start ({first:.0f}) "
            f"with {statistics.fmean(clipped):.0%} truncated, while the reward did not rise"
        )
    return None


CHECKS: dict[str, tuple[Check, str]] = {
    "nonfinite": (_nonfinite, "instant"),
    "kl_spike": (_kl_spike, "instant"),
    "logprob_gap": (_logprob_gap, "streak"),
    "distribution_gap": (_distribution_gap, "instant"),
    "reward_errors": (_reward_errors, "streak"),
    "zero_spread": (_zero_spread, "window"),
    "entropy_collapse": (_entropy_collapse, "window"),
    "length_growth": (_length_growth, "window"),
}
"""Name -> (check, kind): an instant check fires on one step; a streak check once its condition
held health_window steps in a row; a window check reads a whole window itself, so its trouble
began health_window steps back."""


class HealthMonitor:
    """Runs the checks on each step's metrics and says which fired (each once per streak)."""

    def __init__(self, config: HealthConfig) -> None:
        self.config = config
        self.history = History(config.health_window)
        self.streaks: dict[str, int] = {}
        """Per check in a streak: the step it began."""
        self.warned: set[str] = set()
        self.fired: list[Finding] = []
        """Every finding so far, in order."""

    def update(self, step: int, metrics: Mapping[str, float]) -> list[Finding]:
        """Check `metrics` (step `step`); the checks that fire now (a stop first)."""
        self.history.add(metrics)
        findings = []
        for name, (check, kind) in CHECKS.items():
            action = getattr(self.config, f"health_{name}")
            if action == "off":
                continue
            message = check(metrics, self.history, self.config)
            if message is None:
                self.streaks.pop(name, None)
                self.warned.discard(name)
                continue
            began = step - self.config.health_window + 1 if kind == "window" else step
            since = self.streaks.setdefault(name, began)
            if kind == "streak" and step - since + 1 < self.config.health_window:
                continue
            if name in self.warned:
                continue
            self.warned.add(name)
            findings.append(Finding(name, step, max(since, 1), message, action))
        self.fired.extend(findings)
        findings.sort(key=lambda finding: finding.action != "stop")
        for finding in findings:
            if finding.action == "warn":
                logger.warning("step %d: health check %s: %s", step, finding.check, finding.message)
        return findings


def stop_message(stop: Finding, saved: Path, checkpoints: Mapping[int, Path]) -> str:
    """Why the run stopped on `stop`, the checkpoint just `saved`, and the last of the run's
    `checkpoints` (by step) taken before the problem began."""
    good = [path for step, path in sorted(checkpoints.items()) if step < stop.since]
    last_good = (
        f"the last checkpoint before step {stop.since}, when it began: {good[-1]}"
        if good
        else f"no checkpoint precedes step {stop.since}, when it began"
    )
    return (
        f"stopped at step {stop.step}: health check {stop.check} fired ({stop.message}). Checkpoint: "
        f"{saved}; {last_good}. Set health_{stop.check}: warn (or off) to go on regardless"
    )

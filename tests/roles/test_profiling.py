"""Throughput profiling on the tiny model: a finite, non-negative fit that tracks the measured latencies."""
from pathlib import Path

import pytest

from pivotrl.roles.profiling import ProfileConfig, ThroughputProfile, grid, profile_replica

pytestmark = pytest.mark.engine
CONFIG = ProfileConfig(batch_sizes=(1, 4, 16), context_tokens=(16, 160), decode_steps=6, warmup_steps=2)


@pytest.fixture(scope="module")
def profile(make_replica) -> tuple[ThroughputProfile, object]:
    replica = make_replica()
    return profile_replica(replica, CONFIG), replica


def test_samples_cover_the_grid_and_leave_the_replica_empty(profile) -> None:
    result, replica = profile
    assert not replica.has_unfinished() and replica.kv_used_tokens == 0
    points = {(s.num_seqs, s.context_tokens) for s in result.samples}
    assert points == set(grid(replica, CONFIG)) == {(n, c) for n in (1, 4, 16) for c in (16, 160)}
    for s in result.samples:  # KV tokens: prompt + tokens generated so far, for each sequence
        assert s.num_seqs * s.context_tokens < s.num_tokens <= s.num_seqs * (s.context_tokens + 8)
        assert s.latency_s > 0
    assert len(result.samples) + len(result.dropped) >= 0.75 * len(points) * CONFIG.decode_steps
    assert {(s.num_seqs, s.context_tokens) for s in result.samples} == points  # every point keeps its fastest


def test_interference_split_keeps_the_fastest_iterations_per_point() -> None:
    from pivotrl.roles.profiling import ProfileSample, split_interference

    def sample(n: int, ctx: int, lat: float) -> ProfileSample:
        return ProfileSample(num_tokens=n * ctx, num_seqs=n, latency_s=lat, context_tokens=ctx)

    runs = [sample(1, 16, 0.010), sample(1, 16, 0.011), sample(1, 16, 0.100), sample(4, 16, 0.150), sample(4, 16, 0.140)]
    kept, dropped = split_interference(runs, 1.5)
    assert kept == [runs[0], runs[1], runs[3], runs[4]] and dropped == [runs[2]]


def test_fit_is_finite_and_the_least_squares_fit_of_the_kept_samples(profile) -> None:
    """No claim about the timings themselves (a shared CPU): the saved model is the fit of the samples it
    kept, and no uniformly rescaled model (same kink) has a smaller relative squared error on them."""
    from pivotrl.scheduler import ThroughputModel

    result, _ = profile
    fit = result.model
    assert all(0 <= v < 1 for v in fit.as_dict().values())  # finite, non-negative, seconds-sized
    assert fit == ThroughputModel.fit([(s.num_tokens, s.num_seqs, s.latency_s) for s in result.samples])

    def error(model: ThroughputModel) -> float:
        return sum((model.latency(s.num_tokens, s.num_seqs) / s.latency_s - 1) ** 2 for s in result.samples)

    for scale in (0.8, 0.95, 1.05, 1.25):
        scaled = ThroughputModel(**{k: v * scale for k, v in fit.as_dict().items()})
        assert error(fit) <= error(scaled) * (1 + 1e-9), (scale, fit)


def test_profile_round_trips_through_json(profile, tmp_path: Path) -> None:
    result, _ = profile
    result.save(tmp_path / "throughput.json")
    assert ThroughputProfile.load(tmp_path / "throughput.json") == result


def test_grid_skips_points_that_do_not_fit(profile) -> None:
    _, replica = profile
    too_long = ProfileConfig(batch_sizes=(1,), context_tokens=(16, replica.config.max_model_len))
    assert grid(replica, too_long) == [(1, 16)]
    with pytest.raises(ValueError, match="batch_sizes"):
        ProfileConfig(batch_sizes=())

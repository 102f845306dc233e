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


def test_the_fit_cache_is_keyed_by_model_engine_config_and_device(profile, tmp_path: Path, monkeypatch) -> None:
    """A second start of the same engine on the same device reuses the fit; a changed engine config (or
    device kind, or model) is another key, so it profiles anew."""
    import dataclasses

    import pivotrl.roles.profiling as profiling

    _, replica = profile
    # every sample kept (no interference filter): the keying must not depend on how loaded the machine is
    small = ProfileConfig(batch_sizes=(1, 4), context_tokens=(16,), decode_steps=3, warmup_steps=1,
                          interference_factor=1e9)
    first, info = profiling.fit_engine(replica.config, lambda: replica, cache_dir=tmp_path, config=small)
    assert info["source"] == "profile" and (tmp_path / f"{info['key']}.json").exists()
    monkeypatch.setattr(profiling, "profile_replica", lambda *a, **k: pytest.fail("profiled a cached engine"))
    again, info2 = profiling.fit_engine(replica.config, lambda: pytest.fail("made an engine for a cached fit"),
                                        cache_dir=tmp_path, config=small)
    assert info2["source"] == "cache" and info2["key"] == info["key"] and again.model == first.model
    device = profiling.device_kind()
    key = profiling.fit_key(replica.config, device, small)[0]
    assert key == info["key"]
    for changed in (dataclasses.replace(replica.config, max_num_seqs=replica.config.max_num_seqs // 2),
                    dataclasses.replace(replica.config, kv_cache_bytes=(replica.config.kv_cache_bytes or 1 << 26) * 2),
                    dataclasses.replace(replica.config, dtype="bfloat16")):
        assert profiling.fit_key(changed, device, small)[0] != key
    assert profiling.fit_key(replica.config, device + " (another)", small)[0] != key
    assert profiling.fit_key(replica.config, device, dataclasses.replace(small, decode_steps=4))[0] != key
    (tmp_path / f"{key}.json").write_text("{not json")  # a damaged entry is profiled again, not trusted
    monkeypatch.undo()
    _, info3 = profiling.fit_engine(replica.config, lambda: replica, cache_dir=tmp_path, config=small)
    assert info3["source"] == "profile"

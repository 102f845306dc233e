"""The synthetic-length workload (data.lengths = lognormal): every response is generated to the length drawn
for it, the draw is the simulator's law (a function of the run seed and the step), and bad settings are
refused by name."""
from __future__ import annotations

import numpy as np
import pytest

from pivotrl.runtime.book import SyntheticLengths
from pivotrl.runtime.config import ConfigError, DataConfig
from pivotrl.sim.workload import LengthDist


def _lengths(seed: int = 0, share: float = 0.5) -> SyntheticLengths:
    return SyntheticLengths(response=LengthDist(median=24, sigma=0.8, max_tokens=48, group_share=share),
                            judgement=None, seed=seed, prompts_per_step=8, group_size=8)


def test_draws_are_the_laws_and_repeat_per_step() -> None:
    a, b = _lengths(), _lengths()
    steps = [[a.tokens("rollout", s * 64 + i) for i in range(64)] for s in range(40)]
    assert steps[3] == [b.tokens("rollout", 3 * 64 + i) for i in range(64)]  # a resumed run draws the same
    assert steps[0] != steps[1]  # every step its own draw
    flat = np.array(steps)
    assert flat.min() >= 1 and flat.max() <= 48 and (flat == 48).any()  # cut at the budget, mass above it clipped
    assert np.median(flat) == pytest.approx(24, rel=0.15)
    assert a.tokens("reward", 5) is None  # a constrained GenRM ends where its constraint does
    assert _lengths(seed=1).tokens("rollout", 0) != a.tokens("rollout", 0) or \
        [_lengths(seed=1).tokens("rollout", i) for i in range(64)] != steps[0]


def test_a_groups_lengths_share_their_prompts_part() -> None:
    """With the whole log-variance common to a group, its 8 responses have one length."""
    same = _lengths(share=1.0)
    for step in range(3):
        for g in range(8):
            assert len({same.tokens("rollout", step * 64 + g * 8 + k) for k in range(8)}) == 1


@pytest.mark.parametrize("field, value, message", [
    ("lengths", "uniform", "lengths: must be natural or lognormal"),
    ("response_median", 0.0, "response_median: must be a positive"),
    ("judgement_sigma", -1.0, "judgement_sigma: must be >= 0"),
    ("length_group_share", 1.5, "length_group_share: must be in"),
])
def test_bad_settings_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**{field: value})

"""JSON instead of pickle between ranks (``pivotrl.collectives``): what the runtime sends survives the trip,
anything else is refused before it is sent."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pivotrl.collectives import from_json, to_json

_leaf = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text() \
    | st.binary()
_values = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


@given(_values)
def test_values_round_trip(value: object) -> None:
    assert from_json(to_json(value)) == value


def test_nixl_publication_round_trips() -> None:
    published = (b"\x00agent-metadata\xff", [(("gps", "policy", 0, 1), 3, 140_000_000_000)])
    assert from_json(to_json(published)) == published


@pytest.mark.parametrize("value", [{1: "a"}, object(), {"x": {2}}, float("nan")])
def test_other_types_are_refused(value: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        to_json(value)

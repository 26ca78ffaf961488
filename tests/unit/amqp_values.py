"""What the AMQP decoder tests share: header values pamqp's encoder takes, and equality that
tells their types apart (test_frames_decode.py, test_field_table.py)."""

from __future__ import annotations

import datetime
import math
from typing import Any

from hypothesis import strategies as st

__all__ = ["header_values", "same_value"]


def same_value(got: Any, expected: Any) -> bool:
    """Equal, of the same type all the way down (dict order included), NaN equal to NaN."""
    if type(got) is not type(expected):
        return False
    if isinstance(got, dict):
        return list(got) == list(expected) and all(same_value(got[k], expected[k]) for k in got)
    if isinstance(got, list | tuple):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(got, float) and math.isnan(got):
        return math.isnan(expected)
    return bool(got == expected)


header_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(width=32)
    | st.decimals(min_value=-(10**6), max_value=10**6, places=3)
    | st.text(max_size=40)
    | st.datetimes(
        min_value=datetime.datetime(1970, 1, 1), max_value=datetime.datetime(9999, 12, 31)
    ).map(lambda moment: moment.replace(microsecond=0))
    | st.binary(max_size=20).map(bytearray),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
"""Any value pamqp's encoder writes into a header table, nested tables and arrays included."""

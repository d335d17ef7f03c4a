"""The suites' own helpers where they take a shortcut: the shortcut must answer as the
plain computation does."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytest_qconform.suites._cases import has_distinct_at_least


@settings(max_examples=200, deadline=None)
@given(
    distinct=st.integers(1, 40),
    length=st.integers(1, 3000),
    count=st.integers(1, 60),
    seed=st.integers(0, 2**16),
)
def test_distinct_count_by_prefixes_agrees_with_unique(distinct, length, count, seed):
    """Prefixes first, the whole where they fall short: the same answer as ``torch.unique``
    of the whole, whether the distinct values come early, late or not at all."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, distinct, (length,), generator=gen).double() * 0.25
    if seed % 3 == 0:  # the new values only at the end: the prefixes hold one value
        values = torch.cat([torch.zeros(length), torch.arange(distinct).double()])
    assert has_distinct_at_least(values.reshape(-1, 1), count) == (torch.unique(values).numel() >= count)

"""The target merges a flush's ranges before writing them back: same bytes, fewer calls."""

from __future__ import annotations

import random

from rpmemfs.ranges import merge_ranges


def covered(ranges: list[tuple[int, int]]) -> set[int]:
    return {b for off, length in ranges for b in range(off, off + length)}


def test_overlapping_touching_and_empty_ranges() -> None:
    assert merge_ranges([(10, 5), (0, 4), (4, 2), (12, 10), (30, 0), (40, 1)]) == [(0, 6), (10, 12), (40, 1)]
    assert merge_ranges([(0, 64 << 20)] * 8000) == [(0, 64 << 20)]
    assert merge_ranges([]) == []


def test_random_lists_keep_exactly_their_bytes() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ranges = [(rng.randrange(0, 500), rng.randrange(0, 40)) for _ in range(rng.randrange(0, 30))]
        merged = merge_ranges(ranges)
        assert covered(merged) == covered(ranges)
        # Sorted, disjoint and not touching: nothing left to merge.
        for (a, la), (b, _) in zip(merged, merged[1:], strict=False):
            assert a + la < b
        assert all(length > 0 for _, length in merged)

"""Pool byte ranges as every layer passes them: the type, and the one way to merge them.

The filesystem hands a durability point the (offset, length) ranges it changed; the point
persists them and posts them to the replicas; a transport names them in a flush; a target
writes them back. Several of those merge the list first (one flush, frame or write-back per
region instead of one per range). This module sits beneath every layer (it imports nothing
of the package) so that all of them name the same type and merge the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

# (offset, length) pairs; offsets are never negative.
Ranges = list[tuple[int, int]]


def merge_ranges(ranges: Sequence[tuple[int, int]], limit: int | None = None) -> Ranges:
    """The same bytes as ``ranges``: sorted, empty ones dropped, overlapping or touching
    ones joined; with ``limit``, at most that many.

    Merging only ever persists more than asked, which is always safe; to meet ``limit`` the
    smallest gaps are closed first, so the extra bytes stay few. A new list every time: the
    caller may keep appending to the one it passed.
    """
    if len(ranges) < 2:  # nothing to sort or join: one write since the last point, say
        return [ranges[0]] if ranges and ranges[0][1] > 0 else []
    out: Ranges = []
    # The span being built, in locals: a tuple is made once per span, not per range joined.
    start, end = 0, -1
    for off, length in sorted(ranges):
        if off <= end:
            if off + length > end:
                end = off + length
        elif length > 0:
            if end >= 0:
                out.append((start, end - start))
            start, end = off, off + length
    if end >= 0:
        out.append((start, end - start))
    if limit is not None and len(out) > limit:
        out = _close_gaps(out, limit)
    return out


def _close_gaps(merged: Ranges, limit: int) -> Ranges:
    """Sorted, disjoint ranges joined across their smallest gaps until ``limit`` are left
    (at least one)."""
    gaps = sorted(range(len(merged) - 1),
                  key=lambda i: merged[i + 1][0] - (merged[i][0] + merged[i][1]))
    close = set(gaps[: len(merged) - max(limit, 1)])
    joined = [merged[0]]
    for i in range(1, len(merged)):
        if i - 1 in close:
            start = joined[-1][0]
            joined[-1] = (start, merged[i][0] + merged[i][1] - start)
        else:
            joined.append(merged[i])
    return joined

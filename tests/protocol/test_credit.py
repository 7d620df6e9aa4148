"""The consumer's credit window (protocol/credit.py): bounded in batches and in bytes."""

from __future__ import annotations

from dflash.protocol.credit import CreditWindow
import pytest

pytestmark = pytest.mark.unit

MIB = 1 << 20


def drive(w: CreditWindow, sizes: list[int]) -> list[int]:
    """Receive `sizes` one by one, taking each out at once; returns every grant made."""
    grants = [w.to_grant(held=0)]
    for n in sizes:
        w.arrived(n)
        grants.append(w.to_grant(held=0))
    return grants


def test_large_batches_keep_the_floor_and_credit_one_per_batch():
    w = CreditWindow(2, 256 * MIB, max_batches=16)
    grants = drive(w, [640 * MIB] * 5)
    assert w.window == 2 and grants == [2, 1, 1, 1, 1, 1]


def test_small_batches_deepen_the_window_up_to_the_cap_in_quarter_lumps():
    w = CreditWindow(2, 256 * MIB, max_batches=16)
    grants = drive(w, [1 * MIB] * 20)
    assert w.window == 16
    assert grants[:2] == [2, 15]  # first grant: the floor; then up to the window at once
    assert all(g == 0 or g >= 4 for g in grants[2:])  # a credit message per 4 batches, not per batch
    assert sum(grants) - 20 == w.outstanding <= 16


def test_the_bytes_bound_sets_the_depth_between_floor_and_cap():
    w = CreditWindow(2, 256 * MIB, max_batches=16)
    drive(w, [64 * MIB] * 3)
    assert w.window == 4


def test_a_bigger_batch_shrinks_the_window_and_nothing_is_granted_until_it_fits():
    w = CreditWindow(2, 256 * MIB, max_batches=16)
    drive(w, [1 * MIB] * 4)
    assert w.window == 16 and w.outstanding > 4
    w.arrived(128 * MIB)  # the largest recent batch now sets the window
    assert w.window == 2
    held = 3
    assert w.to_grant(held) == 0  # held + promised exceed the window: withhold
    for _ in range(w.outstanding):
        w.arrived(128 * MIB)
    assert w.outstanding == 0 and w.to_grant(held=0) == 2


def test_without_a_bytes_bound_the_window_is_fixed():
    w = CreditWindow(3, None, max_batches=16)
    assert drive(w, [1] * 4) == [3, 1, 1, 1, 1] and w.window == 3


def test_a_grant_never_promises_more_than_the_window_holds():
    """Credit once given cannot be taken back (a shrink waits for it to be used), but a
    grant only ever fills the window up to its bound, never past it."""
    w = CreditWindow(2, 32 * MIB, max_batches=16)
    held, grants = 0, 0
    for i in range(300):
        if w.outstanding and i % 3:
            w.arrived((1 + i % 7) * MIB)
            held += 1
        if i % 5 == 0 and held:
            held -= 1
        if w.to_grant(held):
            grants += 1
            assert w.outstanding + held == w.window
    assert grants > 20

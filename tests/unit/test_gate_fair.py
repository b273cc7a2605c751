"""Fair shares of the gate's queue: bands strictly, keys round-robin within a band, bounded."""

from __future__ import annotations

from kvtax.gate.fair import MAX_KEY_BYTES, RECENT_S, FairShares, Holdings


def test_a_burst_of_one_key_does_not_hold_back_another() -> None:
    """Start-time fair queuing with equal weights: the second key's first request is in the
    round after the one being served, before the burst's later requests."""
    shares = FairShares()
    burst = [shares.turn(0, b"a") for _ in range(4)]
    shares.served(0, burst[0])  # the first of the burst is let through
    other = shares.turn(0, b"b")
    assert burst == [0, 1, 2, 3]
    assert other == 0  # the band's current round: ahead of every request of the burst queued


def test_a_key_back_after_a_while_starts_at_the_current_round() -> None:
    """No credit for a quiet key: it starts where the band is, not where it left off."""
    shares = FairShares()
    early = shares.turn(0, b"quiet")
    for _ in range(10):
        shares.served(0, shares.turn(0, b"busy"))
    assert shares.turn(0, b"quiet") == 9 > early


def test_bands_keep_rounds_of_their_own() -> None:
    shares = FairShares()
    for _ in range(5):
        shares.served(0, shares.turn(0, b"a"))
    assert shares.turn(1, b"a") == 0


def test_the_keys_remembered_are_bounded_and_so_is_a_key() -> None:
    """A client inventing keys grows nothing: the least recently seen are forgotten."""
    shares = FairShares(max_keys=100)
    for i in range(10_000):
        shares.turn(0, str(i).encode())
    assert shares.keys == 100
    band, key = shares.classify([(b"X-Tenant", b"t" * 10_000)], fairness=b"x-tenant", priority=None)
    assert (band, len(key)) == (0, MAX_KEY_BYTES)


def test_a_priority_is_an_integer_in_range_else_0() -> None:
    shares = FairShares()
    read = [
        shares.classify([(b"x-priority", value)], fairness=None, priority=b"x-priority")[0]
        for value in (b"5", b" -3 ", b"high", b"99999", b"")
    ]
    assert read == [5, -3, 0, 0, 0]


def test_a_busy_key_leaves_a_free_slot_for_each_quiet_key_seen_lately() -> None:
    """Reserve: a key holding requests does not take the last free slot while another key seen
    lately holds none; that key may take any free slot. Once it has been quiet for RECENT_S,
    its slot is no longer kept."""
    holdings = Holdings()
    a, b = (0, b"a"), (0, b"b")
    holdings.seen(a, 0.0)
    holdings.seen(b, 0.0)
    assert holdings.may_take(a, cap=2, in_flight=0, now=1.0)  # a holds none
    holdings.took(a)
    assert not holdings.may_take(a, cap=2, in_flight=1, now=1.0)  # the last slot is b's
    assert holdings.may_take(a, cap=3, in_flight=1, now=1.0)
    assert holdings.may_take(b, cap=2, in_flight=1, now=1.0)
    holdings.took(b)  # b holds one now: nothing is kept for it
    assert holdings.may_take(a, cap=3, in_flight=2, now=1.0)
    holdings.seen(a, RECENT_S + 5.0)
    holdings.gave(b)  # b left, and has been quiet since 0
    assert holdings.may_take(a, cap=2, in_flight=1, now=RECENT_S + 5.0)


def test_more_gives_than_takes_hold_nothing() -> None:
    holdings = Holdings()
    a, b = (0, b"a"), (0, b"b")
    holdings.seen(a, 0.0)
    holdings.seen(b, 0.0)
    holdings.gave(b)
    holdings.took(a)
    assert not holdings.may_take(a, cap=2, in_flight=1, now=0.0)  # b still counted as quiet


def test_a_new_key_is_counted_at_once_and_other_bands_not_at_all() -> None:
    """The count of keys seen lately is reused for a second, except when a key turns up:
    then the slots kept free change at its first request. Keys of another band do not count."""
    holdings = Holdings()
    a = (0, b"a")
    holdings.seen(a, 0.0)
    holdings.seen((1, b"other-band"), 0.0)
    holdings.took(a)
    assert holdings.may_take(a, cap=2, in_flight=1, now=0.1)  # the count (1 key in band 0)
    holdings.seen((0, b"b"), 0.2)
    assert not holdings.may_take(a, cap=2, in_flight=1, now=0.3)

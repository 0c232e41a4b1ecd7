"""EventSequencer: the order rules both KV-event subscribers (ZMQ and NATS) share, exactly:
gaps, duplicates, restarts, epochs, and what a replay's answer allows."""

from __future__ import annotations

import pytest

from kvloop.events.protocol import PublisherInfo
from kvloop.events.sequencer import EventSequencer, SubscriberStats, Verdict, history_lost


def _seq(window: int = 4) -> EventSequencer:
    return EventSequencer(SubscriberStats(), dedup_window=window)


def _info(epoch: str = "e1", next_seq: int = 10, oldest_seq: int | None = 5) -> PublisherInfo:
    return PublisherInfo(epoch=epoch, next_seq=next_seq, oldest_seq=oldest_seq)


def test_before_any_batch_the_stream_is_not_in_step():
    s = _seq()
    assert s.expected is None
    assert s.classify(0) is Verdict.FIRST and s.classify(7) is Verdict.FIRST


def test_in_order_batches_apply_and_a_higher_number_is_a_gap_from_expected():
    s = _seq()
    s.expect(0)
    assert s.classify(0, digest=100) is Verdict.APPLY
    s.accept(0, digest=100)
    assert s.expected == 1
    assert s.classify(1) is Verdict.APPLY
    assert s.classify(4) is Verdict.GAP and s.expected == 1   # classify changes nothing


def test_a_lower_number_is_a_duplicate_a_restart_or_behind_by_its_digest():
    s = _seq()
    for n in range(3):
        s.accept(n, digest=100 + n)
    assert s.classify(1, digest=101) is Verdict.DUPLICATE
    assert s.classify(1, digest=999) is Verdict.RESTART      # same number, other content
    assert s.classify(1) is Verdict.RESTART                   # a digest is needed to match


def test_the_digest_window_keeps_only_the_most_recent_batches():
    s = _seq(window=2)
    for n in range(4):
        s.accept(n, digest=100 + n)
    assert s.classify(3, digest=103) is Verdict.DUPLICATE
    assert s.classify(2, digest=102) is Verdict.DUPLICATE
    assert s.classify(1, digest=101) is Verdict.BEHIND        # fell out of the window


def test_without_digests_a_lower_number_is_behind():
    s = _seq()
    s.accept(5)
    assert s.classify(3) is Verdict.BEHIND and s.classify(5) is Verdict.BEHIND


def test_reset_forgets_the_position_and_the_window():
    s = _seq()
    s.accept(3, digest=1)
    s.reset()
    assert s.expected is None and s.classify(3, digest=1) is Verdict.FIRST
    s.expect(0)
    assert s.classify(3, digest=1) is Verdict.GAP


def test_a_snapshot_continues_the_stream_at_its_next_seq():
    st = SubscriberStats()
    s = EventSequencer(st)
    s.synced(_info(next_seq=10))
    assert (s.expected, st.last_seq, st.snapshots) == (10, 9, 1)
    assert s.classify(10) is Verdict.APPLY and s.classify(9) is Verdict.BEHIND
    s.synced(_info(next_seq=0))
    assert (s.expected, st.last_seq, st.snapshots) == (0, None, 2)


def test_a_publishers_next_seq_reveals_batches_lost_at_the_tail():
    s = _seq()
    assert s.missing_before(5) is None                  # not in step: nothing to count from
    assert s.missing_before(5, from_start=True) == 0    # a replay socket holds the start
    assert s.missing_before(0, from_start=True) is None
    s.accept(2)
    assert s.missing_before(3) is None and s.missing_before(4) == 3


def test_epochs_the_first_is_adopted_another_is_a_restart():
    st = SubscriberStats()
    s = EventSequencer(st)
    assert not s.epoch_changed("e1")                     # none known yet
    assert s.adopt_epoch("e1") and (s.epoch, st.epochs_seen) == ("e1", 1)
    assert not s.adopt_epoch("e1") and st.epochs_seen == 1
    assert not s.epoch_changed("e1") and s.epoch_changed("e2")
    s.forget_epoch()
    assert s.epoch is None and not s.epoch_changed("e2")


@pytest.mark.parametrize("start,info,lost", [
    (7, _info(next_seq=10, oldest_seq=5), False),     # still buffered
    (5, _info(next_seq=10, oldest_seq=5), False),
    (4, _info(next_seq=10, oldest_seq=5), True),      # older than the buffer
    (4, _info(next_seq=10, oldest_seq=None), True),   # nothing buffered
    (10, _info(next_seq=10, oldest_seq=None), False),  # nothing missing
])
def test_history_lost(start, info, lost):
    assert history_lost(start, info) is lost


def test_a_replays_answer_replay_snapshot_or_epoch():
    st = SubscriberStats()
    s = EventSequencer(st)
    assert s.replay_verdict(6, _info("e1")) is Verdict.REPLAY
    assert s.epoch == "e1"                                # adopted with the answer
    assert s.replay_verdict(2, _info("e1")) is Verdict.SNAPSHOT
    assert s.replay_verdict(6, _info("e2")) is Verdict.EPOCH
    assert s.epoch == "e1"                                # a restart is the caller's to handle


def test_dedup_window_must_hold_one_batch():
    with pytest.raises(ValueError):
        EventSequencer(SubscriberStats(), dedup_window=0)

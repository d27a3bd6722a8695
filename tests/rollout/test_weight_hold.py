"""One trainer at a time per server (``honing.rollout.remote.hold``): the server's holder
on a clock the test moves, and the trainer's keeper that renews its holds."""

import gc
import threading

import pytest

from honing.rollout.remote.hold import HOLD_S, HeldElsewhere, Holder, Keeper, lapses_in


def test_a_server_holds_to_one_trainer_until_it_lets_go_or_falls_silent():
    now = [100.0]
    holder = Holder(clock=lambda: now[0])
    holder.hold("")  # an update sent by hand takes nothing
    holder.hold("a")
    with pytest.raises(HeldElsewhere, match="takes its weights from trainer a"):
        holder.hold("b")
    now[0] += HOLD_S - 1
    holder.hold("a")  # renewed
    now[0] += HOLD_S - 1
    with pytest.raises(HeldElsewhere, match="an update without a trainer id refused"):
        holder.hold("")
    holder.release("b")  # not b's to let go
    with pytest.raises(HeldElsewhere):
        holder.hold("b")
    now[0] += 1  # a silent for HOLD_S: it let go
    holder.hold("b")
    holder.release("b")
    holder.hold("c")


def test_the_keeper_renews_until_closed_or_its_engine_is_gone():
    class Engine:
        pass

    renewed = []
    again = threading.Event()

    def renew(engine, url):
        renewed.append(url)
        again.set()

    engine = Engine()
    keeper = Keeper(engine, renew, every_s=0.01)
    keeper.add("http://a")
    assert again.wait(5)
    assert keeper.close() == ["http://a"]
    count = len(renewed)
    threading.Event().wait(0.05)
    assert len(renewed) <= count + 1  # a renewal under way may end

    dropped = Keeper(Engine(), renew, every_s=0.01)  # its engine is gone at once
    dropped.add("http://b")
    gc.collect()
    dropped._thread.join(5)
    assert not dropped._thread.is_alive() and "http://b" not in renewed


def test_a_trainer_refused_by_a_silent_holder_waits_for_its_hold_to_lapse():
    """A run restarted after a crash finds its former self holding the server: silent for
    more than two renewals, it is waited out; a live holder is not."""
    now = [0.0]
    holder = Holder(clock=lambda: now[0])
    holder.hold("gone")
    for silent, wait in ((3.0, None), (15.0, HOLD_S - 15 + 1)):
        now[0] = silent
        with pytest.raises(HeldElsewhere) as refused:
            holder.hold("restarted")
        assert lapses_in(f"HTTP 409: {refused.value}") == wait
    assert lapses_in("HTTP 409: weights: the update lacks (heard from 20 s ago)") is None

"""agent/events.EventQueue: the one drain every probe with events uses."""
import threading

from gpuwatch.agent.api import Event
from gpuwatch.agent.events import EventQueue


def ev(n):
    return Event("k", str(n))


def test_refuses_the_newest_when_full_and_counts_it():
    q = EventQueue(2)
    assert [q.put(ev(n)) for n in range(4)] == [True, True, False, False]
    assert [e.resource for e in q.drain()] == ["0", "1"] and q.dropped == 2
    assert q.drain() == [] and q.put(ev(9)) and [e.resource for e in q.drain()] == ["9"]


def test_drop_oldest_keeps_the_latest_and_counts_it():
    q = EventQueue(2, drop_oldest=True)
    assert [q.put(ev(n)) for n in range(3)] == [True, True, False]
    assert [e.resource for e in q.drain()] == ["1", "2"] and q.dropped == 1


def test_no_bound_keeps_everything():
    q = EventQueue(None)
    assert all(q.put(ev(n)) for n in range(1000))
    assert len(q.drain()) == 1000 and q.dropped == 0


def test_threads_lose_nothing_below_the_bound():
    q, got = EventQueue(4000), []
    threads = [threading.Thread(target=lambda t=t: [q.put(ev(t * 1000 + n)) for n in range(1000)]) for t in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        got += q.drain()
    for t in threads:
        t.join()
    got += q.drain()
    assert sorted(int(e.resource) for e in got) == list(range(4000)) and q.dropped == 0

"""loader.in_parallel: what the probe's load uses to let the kernel's work overlap (maps, the
verifier, link closes). Results come back in the items' order, each failure with its item, and
the calls really run at once (a barrier that needs all of them passes)."""
from __future__ import annotations

import threading

from gpuwatch.probes.ebpf.loader import in_parallel


def test_results_in_order_and_failures_with_their_items():
    def fn(i: int) -> int:
        if i % 3 == 0:
            raise OSError(i, "refused")
        return i * i

    results, errors = in_parallel(fn, list(range(10)), 4)
    assert results == [None if i % 3 == 0 else i * i for i in range(10)]
    assert sorted(item for item, _ in errors) == [0, 3, 6, 9]
    assert all(isinstance(e, OSError) and e.errno == item for item, e in errors)


def test_the_calls_run_at_once():
    barrier = threading.Barrier(4, timeout=10)  # broken (an error) unless four calls wait at once
    results, errors = in_parallel(lambda i: barrier.wait() >= 0, list(range(4)), 4)
    assert errors == [] and results == [True] * 4


def test_no_more_threads_than_asked():
    seen: set[str] = set()
    lock = threading.Lock()

    def fn(i: int) -> int:
        with lock:
            seen.add(threading.current_thread().name)
        return i

    assert in_parallel(fn, list(range(50)), 3) == (list(range(50)), [])
    assert 1 <= len(seen) <= 3
    assert in_parallel(fn, [], 3) == ([], [])

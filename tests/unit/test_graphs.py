"""GraphBook (probes/ebpf/graphs.py) on events as the BPF side writes them: what a process sends is
followed exactly where it can be, said to be partial or unknown where it cannot, and bounded."""
from __future__ import annotations

import ctypes
import logging
import threading

import pytest

from gpuwatch.agent.budget import Budget
from gpuwatch.probes.ebpf import graphs, symbols as S

PID = 4242
F, G = 0x1000, 0x2000  # kernel handles


def ev(kind: int, **fields) -> bytes:
    e = graphs.EVENT()
    e.pid, e.kind = fields.pop("pid", PID), kind
    dims = fields.pop("dims", (1, 1, 1, 32, 1, 1))
    for name, v in zip(("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"), dims):
        setattr(e.dims, name, v)
    for k, v in fields.items():
        setattr(e, k, v)
    return bytes(e)


def capture(book: graphs.GraphBook, cid: int, graph: int, functions: list[int], count: int | None = None,
            end_ts: int | None = None) -> None:
    book.on_event(ev(S.GE_BEGIN, capture=cid, ts=cid))
    for f in functions:
        book.on_event(ev(S.GE_NODE, capture=cid, function=f, dims=(4, 1, 1, 32, 1, 1)))
    book.on_event(ev(S.GE_END, capture=cid, graph=graph, count=len(functions) if count is None else count,
                     ts=end_ts or cid + 10))


def instantiate(book, graph: int, exec_: int, serial: int) -> None:
    book.on_event(ev(S.GE_INSTANTIATE, graph=graph, exec=exec_, serial=serial))


def test_replays_times_nodes():
    book = graphs.GraphBook()
    capture(book, 100, 0xa, [F, F, G])
    instantiate(book, 0xa, 0xe, 5)
    book.account({(PID, 0xe): (5, 7)})
    book.account({(PID, 0xe): (5, 9)})  # cumulative: only the 2 new replays are added
    k = book.kernels(PID)
    assert k[(PID, F)]["launches"] == 18 and k[(PID, G)]["launches"] == 9
    assert k[(PID, F)]["grid"] == [4, 1, 1]
    assert book.summary(PID)["launches"] == 9 and book.summary(PID)["kernel_launches"] == 27


def test_a_capture_with_launches_unprobed_or_nodes_lost_is_partial():
    book = graphs.GraphBook(launches_seen=lambda begin, end: begin != 200)
    capture(book, 200, 0xa, [F])  # the launch probes were off meanwhile
    capture(book, 300, 0xb, [F], count=2)  # the kernel side counted 2 nodes, 1 arrived
    capture(book, 400, 0xc, [F])
    for i, g in enumerate((0xa, 0xb, 0xc)):
        instantiate(book, g, 0xe0 + i, 1)
    book.account({(PID, 0xe0): (1, 1), (PID, 0xe1): (1, 1), (PID, 0xe2): (1, 1)})
    s = book.summary(PID)
    assert (s["launches"], s["partial_content_launches"], s["kernel_launches"]) == (3, 2, 3)


def test_an_executable_graph_made_before_the_probe_is_unknown_and_its_kernels_not_guessed():
    book = graphs.GraphBook()
    book.account({(PID, 0xe): (0, 17)})
    s = book.summary(PID)
    assert (s["launches"], s["unknown_content_launches"], s["kernel_launches"]) == (17, 17, 0)
    assert book.kernels(PID) == {}


def test_a_serial_not_seen_yet_waits_for_its_event():
    book = graphs.GraphBook()
    book.account({(PID, 0xe): (9, 3)})  # instantiated after the events taken: nothing counted yet
    assert book.summary(PID)["launches"] == 0
    capture(book, 100, 0xa, [F])
    instantiate(book, 0xa, 0xe, 9)
    book.account({(PID, 0xe): (9, 3)})
    assert book.summary(PID)["kernel_launches"] == 3


def test_destroy_brings_the_last_launches_and_a_reused_address_is_another_graph():
    book = graphs.GraphBook()
    capture(book, 100, 0xa, [F])
    capture(book, 200, 0xb, [G, G])
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 2)})
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0xe, serial=1, count=5))  # 3 more since the last read
    instantiate(book, 0xb, 0xe, 2)  # the same address again
    book.account({(PID, 0xe): (2, 1)})
    k = book.kernels(PID)
    assert k[(PID, F)]["launches"] == 5 and k[(PID, G)]["launches"] == 2


def test_changes_apply_from_when_they_were_made():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x77, function=F))
    instantiate(book, 0xa, 0xe, 1)
    book.on_event(ev(S.GE_SET, exec=0xe, node=0x77, function=G, serial=1, count=4))  # 4 replays ran F
    book.account({(PID, 0xe): (1, 6)})
    k = book.kernels(PID)
    assert k[(PID, F)]["launches"] == 4 and k[(PID, G)]["launches"] == 2
    assert book.summary(PID)["partial_content_launches"] == 0
    # a node never seen made: the exec's content is no longer known whole
    book.on_event(ev(S.GE_SET, exec=0xe, node=0x99, function=F, serial=1, count=6))
    book.account({(PID, 0xe): (1, 7)})
    assert book.summary(PID)["partial_content_launches"] == 1


def test_bounds_hold_against_a_process_that_floods():
    # each dimension's own bound (a budget too large to matter here: its test is below)
    book = graphs.GraphBook(budget=Budget("graphs", 1 << 40, 1 << 40), uid_of=lambda pid: 1000)
    for i in range(graphs.MAX_GRAPHS_PER_PROCESS + 10):
        book.on_event(ev(S.GE_CREATE, graph=0x10 + i))
    assert book.summary(PID)["graphs"] == graphs.MAX_GRAPHS_PER_PROCESS and book.overflow == 10
    book.on_event(ev(S.GE_BEGIN, capture=1))
    for i in range(graphs.MAX_SPECS_PER_GRAPH + 5):  # distinct configurations: the graph is partial
        book.on_event(ev(S.GE_NODE, capture=1, function=F + i))
    book.on_event(ev(S.GE_END, capture=1, graph=0x10, count=graphs.MAX_SPECS_PER_GRAPH + 5))
    instantiate(book, 0x10, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    s = book.summary(PID)
    assert s["partial_content_launches"] == 1 and s["kernel_launches"] == graphs.MAX_SPECS_PER_GRAPH
    for pid in range(1, graphs.MAX_PROCESSES + 3):
        book.on_event(ev(S.GE_CREATE, graph=1, pid=pid))
    assert len(book.per_process()) == graphs.MAX_PROCESSES
    # 4242's own graph 1 had no room; 2 of the others (4242 was among them) no process
    assert book.overflow == 10 + 1 + 2
    for i in range(graphs.MAX_GRAPHS_PER_PROCESS):  # one exec there already: the last one is refused
        instantiate(book, 0x11, 0x100 + i, 1)
    assert book.overflow == 14
    book.account({(PID, 0xbad): (0, 5)})  # made before the probe, no room to follow it
    assert book.overflow == 15 and book.summary(PID)["launches"] == 1


def test_the_product_of_the_bounds_is_bounded_per_user_and_node_wide(caplog):
    """One graph of 4,096 distinct nodes instantiated 4,096 times held each bound alone and took
    ~600 MB: the "graphs" budget bounds the product. The flooding user's replays go partial or
    unknown, and the refusals are counted and said once; another user's graphs stay exact; what
    a process held goes back when it exits."""
    budget = Budget("graphs", 4 << 20, 6 << 20)
    uids = {PID: 65534, 4243: 65534, 5000: 1000}
    book = graphs.GraphBook(budget=budget, uid_of=uids.__getitem__)
    nodes = graphs.MAX_SPECS_PER_GRAPH
    for pid in (PID, 4243):
        book.on_event(ev(S.GE_BEGIN, capture=1, pid=pid))
        for i in range(nodes):
            book.on_event(ev(S.GE_NODE, capture=1, function=F, dims=(i + 1, 1, 1, 32, 1, 1), pid=pid))
        book.on_event(ev(S.GE_END, capture=1, graph=0xa, count=nodes, pid=pid))
        for i in range(graphs.MAX_GRAPHS_PER_PROCESS):
            instantiate(book, 0xa, 0x100 + i, 1) if pid == PID else \
                book.on_event(ev(S.GE_INSTANTIATE, graph=0xa, exec=0x100 + i, serial=1, pid=pid))
    assert budget.used(65534) <= 4 << 20 and budget.refused["user"] > 0
    refused = budget.refused["user"]
    capture(book, 100, 0xb, [G, G])  # the flooding user's new graph: no room, counted
    assert budget.refused["user"] > refused
    # another user: room of their own, exact
    uid_before = budget.used(1000)
    book.on_event(ev(S.GE_BEGIN, capture=7, pid=5000))
    for f in (F, F, G):
        book.on_event(ev(S.GE_NODE, capture=7, function=f, pid=5000))
    book.on_event(ev(S.GE_END, capture=7, graph=0xc, count=3, ts=20, pid=5000))
    book.on_event(ev(S.GE_INSTANTIATE, graph=0xc, exec=0xe, serial=1, pid=5000))
    book.account({(5000, 0xe): (1, 10), (PID, 0x100): (1, 2), (PID, 0x100 + nodes - 1): (1, 3)})
    assert budget.used(1000) > uid_before
    k = book.kernels(5000)
    assert k[(5000, F)]["launches"] == 20 and k[(5000, G)]["launches"] == 10
    assert book.summary(5000)["partial_content_launches"] == book.summary(5000)["unknown_content_launches"] == 0
    s = book.summary(PID)
    # its first executable graph is followed; its last had no room at all: its replays are counted
    # as of unknown content, their kernels not guessed
    assert s["launches"] == 5 and s["unknown_content_launches"] == 3 and book.overflow > 0
    book.account({(PID, 0x100 + nodes - 1): (1, 4), (PID, 0x100 + nodes - 2): (1, 1)})
    assert book.summary(PID)["unknown_content_launches"] == 5
    assert len([r for r in caplog.records if r.name == "gpuwatch.budget"]) == 1  # said once, however often refused
    assert budget.used() <= 6 << 20
    book.forget({PID, 4243, 5000})
    assert budget.used() == 0


def test_short_or_unknown_events_are_ignored_and_exited_processes_forgotten():
    book = graphs.GraphBook()
    book.on_event(b"\x01" * (ctypes.sizeof(graphs.EVENT) - 1))
    book.on_event(ev(99, graph=1))
    book.on_event(ev(S.GE_NODE, capture=5, function=F))  # its begin lost: partial, not dropped
    book.on_event(ev(S.GE_END, capture=5, graph=0xa, count=1))
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    assert book.summary(PID)["partial_content_launches"] == 1
    book.forget({PID})
    assert book.summary(PID) == graphs.GraphBook().summary()


D = (8, 2, 1, 128, 2, 1)  # a node's grid and block: not degenerate


def test_explicit_nodes_follow_set_params_clone_update_and_destroy():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F, dims=D, shared_mem=512))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x72, function=F, dims=D, shared_mem=512))
    book.on_event(ev(S.GE_SET, node=0x71, function=G, dims=D))  # before instantiation: the graph itself
    book.on_event(ev(S.GE_CLONE, graph=0xb, source=0xa))  # F + G, its nodes' handles unseen
    book.on_event(ev(S.GE_SET, node=0x72, function=G, dims=D))  # 0xa only: G + G; all F nodes gone
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 0xb, 0xf, 1)
    book.account({(PID, 0xe): (1, 0), (PID, 0xf): (1, 0)})
    assert book.kernels(PID) == {}  # no replay yet: no kernel
    book.account({(PID, 0xe): (1, 3), (PID, 0xf): (1, 1)})
    k = book.kernels(PID)
    assert k[(PID, F)] == {"launches": 1, "degenerate_launches": 0, "grid": [8, 2, 1], "block": [128, 2, 1],
                           "shared_mem_bytes": 512}
    assert k[(PID, G)]["launches"] == 7
    s = book.summary(PID)
    assert (s["graphs"], s["executable_graphs"], s["partial_content_launches"]) == (2, 2, 0)
    # the exec of 0xa takes the clone's content after 4 replays in all
    book.on_event(ev(S.GE_UPDATE, exec=0xe, serial=1, graph=0xb, count=4))
    book.account({(PID, 0xe): (1, 6), (PID, 0xf): (1, 1)})
    k = book.kernels(PID)
    assert (k[(PID, F)]["launches"], k[(PID, G)]["launches"]) == (3, 11)
    book.on_event(ev(S.GE_DESTROY, graph=0xa))
    book.on_event(ev(S.GE_SET, node=0x72, function=F, dims=D))  # its graph is gone: nothing to change
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0xf, serial=1, count=2))
    s = book.summary(PID)
    assert (s["graphs"], s["executable_graphs"], s["kernel_launches"]) == (1, 1, 16)
    # an update to a graph not known: what the exec runs from then on is unknown
    book.on_event(ev(S.GE_UPDATE, exec=0xe, serial=1, graph=0x99, count=6))
    book.account({(PID, 0xe): (1, 8)})
    s = book.summary(PID)
    assert (s["unknown_content_launches"], s["kernel_launches"], s["executable_graphs"]) == (2, 16, 0)


def test_a_node_set_twice_and_one_of_two_alike_replaced():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    for node in (0x71, 0x72):
        book.on_event(ev(S.GE_ADD, graph=0xa, node=node, function=F))
    book.on_event(ev(S.GE_SET, node=0x71, function=G))
    book.on_event(ev(S.GE_SET, node=0x71, function=F + 1))  # G's only node changed again: no G left
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F: 1, F + 1: 1}
    assert book.kernels(PID)[(PID, F)]["degenerate_launches"] == 1  # the default 1x1x1 grid


def test_a_capture_into_an_existing_graph_adds_to_it():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F))
    book.on_event(ev(S.GE_BEGIN, capture=100, graph=0xa, ts=100))
    assert book.summary(PID)["captures_in_progress"] == 1 and book.captures_begun == 1
    book.on_event(ev(S.GE_NODE, capture=100, function=F))
    book.on_event(ev(S.GE_NODE, capture=100, function=G))
    book.on_event(ev(S.GE_END, capture=100, graph=0xa, count=2, ts=110))
    s = book.summary(PID)
    assert (s["graphs"], s["captures_in_progress"]) == (1, 0)
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    k = book.kernels(PID)
    assert (k[(PID, F)]["launches"], k[(PID, G)]["launches"]) == (2, 1)
    assert book.summary(PID)["partial_content_launches"] == 0
    # a second capture into it with a node lost makes the whole graph partial
    book.on_event(ev(S.GE_BEGIN, capture=200, graph=0xa, ts=200))
    book.on_event(ev(S.GE_END, capture=200, graph=0xa, count=1, ts=210))
    instantiate(book, 0xa, 0xe, 2)
    book.account({(PID, 0xe): (2, 1)})
    assert book.summary(PID)["partial_content_launches"] == 1


def test_what_was_made_before_the_probe_or_lost_is_unknown_or_partial():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_END, capture=7, graph=0xa, count=0))  # its begin lost, and empty: complete
    book.on_event(ev(S.GE_END, capture=8, graph=0xb, count=2))  # its begin and 2 nodes lost
    book.on_event(ev(S.GE_END, capture=9, graph=0, count=0))  # a failed capture: no graph
    book.on_event(ev(S.GE_ADD, graph=0xc, node=0x71, function=F))  # a graph made before the probe
    instantiate(book, 0x99, 0xd, 1)  # of a graph never seen
    assert book.summary(PID)["graphs"] == 3
    for i, g in enumerate((0xa, 0xb, 0xc)):
        instantiate(book, g, 0xe0 + i, 1)
    book.account({(PID, 0xe0): (1, 1), (PID, 0xe1): (1, 2), (PID, 0xe2): (1, 4), (PID, 0xd): (1, 8)})
    s = book.summary(PID)
    assert (s["launches"], s["partial_content_launches"], s["unknown_content_launches"]) == (15, 6, 8)
    assert book.kernels(PID)[(PID, F)]["launches"] == 4


def test_processes_are_kept_apart_and_new_ones_announced():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_PROCESS, pid=7))
    book.on_event(ev(S.GE_PROCESS, pid=8))
    assert book.new_processes == {7, 8} and book.summary() == graphs.GraphBook().summary()
    for pid, n in ((1, 2), (PID, 3)):
        book.on_event(ev(S.GE_CREATE, graph=0xa, pid=pid))
        book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F, pid=pid, dims=D))
        book.on_event(ev(S.GE_INSTANTIATE, graph=0xa, exec=0xe, serial=1, pid=pid))
        book.account({(pid, 0xe): (1, n)})
    assert book.kernels(PID) == {(PID, F): {"launches": 3, "degenerate_launches": 0, "grid": [8, 2, 1],
                                            "block": [128, 2, 1], "shared_mem_bytes": 0}}
    assert book.summary(PID)["kernel_launches"] == 3 and book.summary()["kernel_launches"] == 5
    assert book.per_process() == {1: (2, {"known": 2}), PID: (3, {"known": 3})}
    book.forget({1, 99})
    assert list(book.per_process()) == [PID]


def test_events_about_what_was_never_seen_change_nothing_and_counts_add_up():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_DESTROY, graph=0x55))  # made and destroyed outside what we saw
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0x56, serial=3, count=9))
    book.on_event(ev(S.GE_SET, exec=0x57, serial=3, node=0x71, function=F, count=1))
    book.account({(PID, 0xe): (0, 17)})
    book.account({(PID, 0xe): (0, 20)})  # cumulative, as for any exec
    assert book.summary(PID)["unknown_content_launches"] == 20
    # a destroyed graph's nodes are forgotten: a new graph at its address is not changed through them
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F))
    book.on_event(ev(S.GE_DESTROY, graph=0xa))
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x72, function=G))
    book.on_event(ev(S.GE_SET, node=0x71, function=F + 1))
    instantiate(book, 0xa, 0xf, 1)
    book.account({(PID, 0xf): (1, 2)})
    book.account({(PID, 0xf): (1, 3)})
    k = book.kernels(PID)
    assert list(k) == [(PID, G)] and k[(PID, G)]["degenerate_launches"] == 3
    assert book.summary(PID)["partial_content_launches"] == 0


def test_the_summary_of_all_processes_sums_them():
    book = graphs.GraphBook()
    for pid in (1, 2):
        book.on_event(ev(S.GE_CREATE, graph=0xa, pid=pid))
        book.on_event(ev(S.GE_INSTANTIATE, graph=0xa, exec=0xe, serial=1, pid=pid))
        book.on_event(ev(S.GE_BEGIN, capture=5, pid=pid))
    s = book.summary()
    assert (s["graphs"], s["executable_graphs"], s["captures_in_progress"]) == (2, 2, 2)
    assert book.captures_begun == 2


# ---- what each entry is charged to the "graphs" budget, and given back ----------------------------
GB, SB, CB, HB, KB = graphs.GRAPH_BYTES, graphs.SPEC_BYTES, graphs.COPY_BYTES, graphs.HANDLE_BYTES, graphs.KERNEL_BYTES
U = 1000


def budgeted(per_user: int = 1 << 30, **kw) -> tuple[graphs.GraphBook, Budget]:
    budget = Budget("graphs", per_user, 1 << 30)
    return graphs.GraphBook(budget=budget, uid_of=lambda pid: U, **kw), budget


def test_every_entry_is_charged_and_given_back_exactly():
    book, budget = budgeted()
    book.on_event(ev(S.GE_CREATE, graph=0xa, pid=77))  # another process of the same user: untouched below
    base = GB
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_CREATE, graph=0xa))  # the same address again: the first one is given back
    assert budget.used(U) == base + GB
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F))  # its configuration, handle and owner
    assert budget.used(U) == base + GB + SB + 2 * HB
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x72, function=F))  # a configuration already there
    graph_a = GB + SB + 4 * HB
    assert budget.used(U) == base + graph_a
    book.on_event(ev(S.GE_BEGIN, capture=9))
    book.on_event(ev(S.GE_BEGIN, capture=9))  # begun again: the first capture is given back
    assert budget.used(U) == base + graph_a + GB
    book.on_event(ev(S.GE_END, capture=9, graph=0, count=0))  # failed: nothing kept
    assert budget.used(U) == base + graph_a
    book.on_event(ev(S.GE_CLONE, graph=0xb, source=0xa))  # one entry copied, not the handles
    clone = GB + CB
    assert budget.used(U) == base + graph_a + clone
    instantiate(book, 0xa, 0xe, 1)  # the executable graph, and its copy with the handles
    exec_e = GB + GB + CB + 2 * HB
    assert budget.used(U) == base + graph_a + clone + exec_e
    book.on_event(ev(S.GE_SET, exec=0xe, serial=1, node=0x71, function=G))  # a new configuration
    assert budget.used(U) == base + graph_a + clone + exec_e + SB
    book.on_event(ev(S.GE_SET, exec=0xe, serial=1, node=0x72, function=G))  # F's entry gone
    exec_e += SB - CB
    assert budget.used(U) == base + graph_a + clone + exec_e
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0xe, serial=1))
    assert budget.used(U) == base + graph_a + clone
    instantiate(book, 0xa, 0xf, 2)
    instantiate(book, 0xa, 0xf, 2)  # the same one again: the first is given back
    assert budget.used(U) == base + graph_a + clone + GB + GB + CB + 2 * HB
    book.on_event(ev(S.GE_UPDATE, exec=0xf, serial=2, graph=0xb))  # now the clone's content, no handles
    assert budget.used(U) == base + graph_a + clone + GB + GB + CB
    book.on_event(ev(S.GE_DESTROY, graph=0xa))  # the graph, its handles and their owners
    assert budget.used(U) == base + clone + GB + GB + CB
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0xf, serial=2))
    assert budget.used(U) == base + clone
    book.on_event(ev(S.GE_CREATE, graph=0xc))
    book.on_event(ev(S.GE_ADD, graph=0xc, node=0x75, function=F))
    book.on_event(ev(S.GE_ADD, graph=0xc, node=0x75, function=F))  # a handle already kept: nothing more
    assert budget.used(U) == base + clone + GB + SB + 2 * HB
    book.forget({PID})  # what is left of it: the other process's graph stays charged
    assert budget.used(U) == base
    book.clear()
    assert budget.used() == 0 and book.summary() == graphs.GraphBook().summary()


def test_what_the_budget_refuses_is_counted_once_each_and_made_unknown():
    book, budget = budgeted()
    capture(book, 100, 0xa, [F])
    budget.per_user = budget.used(U) + GB + GB  # room for an executable graph, not its copy
    instantiate(book, 0xa, 0xe, 1)
    assert book.overflow == 1
    budget.per_user = budget.used(U)
    book.on_event(ev(S.GE_CREATE, graph=0xb))
    assert book.overflow == 2 and book.summary(PID)["graphs"] == 1
    book.on_event(ev(S.GE_BEGIN, capture=200))
    assert book.overflow == 3 and book.summary(PID)["captures_in_progress"] == 0
    book.on_event(ev(S.GE_NODE, capture=300, function=F))  # its begin lost, and no room for it
    assert book.overflow == 4
    book.on_event(ev(S.GE_END, capture=400, graph=0xc, count=1))  # the same
    assert book.overflow == 5 and book.summary(PID)["graphs"] == 1
    nodes = [[F, 1, 1, 1, 32, 1, 1, 0, 1]]
    assert book.preload(PID, [{"exec": 0x70, "complete": True, "nodes": nodes},
                              {"exec": 0x71, "complete": True, "nodes": nodes}]) == 0
    assert book.overflow == 7
    budget.per_user = 1 << 30
    instantiate(book, 0x99, 0xd, 1)  # of a graph never seen: unknown, but nothing refused
    assert book.overflow == 7
    book.account({(PID, 0xe): (1, 2), (PID, 0xd): (1, 1)})
    s = book.summary(PID)
    assert (s["launches"], s["unknown_content_launches"], s["kernel_launches"]) == (3, 3, 0)
    budget.per_user = budget.used(U) + GB  # again: the copy refused, counted once more
    instantiate(book, 0xa, 0xf, 2)
    assert book.overflow == 8


def test_a_node_past_the_budget_makes_its_graph_partial_and_is_not_counted():
    book, budget = budgeted()
    book.on_event(ev(S.GE_BEGIN, capture=100, ts=100))
    book.on_event(ev(S.GE_NODE, capture=100, function=F, dims=D))
    budget.per_user = budget.used(U)  # no room for G's configuration
    book.on_event(ev(S.GE_NODE, capture=100, function=G, dims=D))
    book.on_event(ev(S.GE_END, capture=100, graph=0xa, count=2, ts=110))
    budget.per_user = 1 << 30
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 2)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F: 2}
    assert book.summary(PID)["partial_content_launches"] == 2
    assert book.export(PID) == {"execs": [{"exec": 0xe, "complete": False, "nodes": [[F, *D, 0, 1]]}],
                                "truncated": False}


def test_a_handle_kept_without_room_for_its_owner_is_not_followed_and_its_destroy_gives_back():
    book, budget = budgeted()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    before = budget.used(U)
    budget.per_user = before + SB + HB  # the configuration and the graph's handle, not the owner's
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F))
    assert budget.used(U) == before + SB + HB
    budget.per_user = 1 << 30
    book.on_event(ev(S.GE_SET, node=0x71, function=G))  # not owned: the graph is not changed through it
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    assert list(book.kernels(PID)) == [(PID, F)] and book.summary(PID)["partial_content_launches"] == 0
    book.on_event(ev(S.GE_DESTROY, graph=0xa))
    book.on_event(ev(S.GE_EXEC_DESTROY, exec=0xe, serial=1, count=1))
    assert budget.used(U) == KB and book.summary(PID)["graphs"] == 0  # F's running counts: until it exits


def test_a_node_added_to_a_second_graph_without_room_for_its_handle_stays_with_the_first():
    book, budget = budgeted()
    for graph in (0xa, 0xb):
        book.on_event(ev(S.GE_CREATE, graph=graph))
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F))
    budget.per_user = budget.used(U) + SB  # 0xb's configuration, not its handle
    book.on_event(ev(S.GE_ADD, graph=0xb, node=0x71, function=G))
    budget.per_user = 1 << 30
    book.on_event(ev(S.GE_SET, node=0x71, function=F + 1))  # changes 0xa's node
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 0xb, 0xf, 1)
    book.account({(PID, 0xe): (1, 1), (PID, 0xf): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F + 1: 1, G: 1}
    assert book.summary(PID)["partial_content_launches"] == 0


def test_a_kernel_without_room_makes_its_replay_partial_and_the_others_still_count():
    book, budget = budgeted()
    capture(book, 100, 0xa, [F + 2])
    instantiate(book, 0xa, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})  # F + 2 has its running counts now
    capture(book, 200, 0xb, [F, G, F + 2])
    instantiate(book, 0xb, 0xf, 1)
    budget.per_user = budget.used(U) + KB  # room for F's counts, not G's
    book.account({(PID, 0xe): (1, 1), (PID, 0xf): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F + 2: 2, F: 1}
    s = book.summary(PID)
    assert (s["launches"], s["partial_content_launches"]) == (2, 1)
    assert book.per_process()[PID] == (3, {"known": 1, "partial": 1})


def test_the_bounds_on_captures_handles_and_announced_processes(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS_PER_PROCESS", 2)
    monkeypatch.setattr(graphs, "MAX_HANDLES_PER_GRAPH", 2)
    monkeypatch.setattr(graphs, "MAX_PROCESSES", 2)
    book = graphs.GraphBook()
    for pid in (1, 2, 3):
        book.on_event(ev(S.GE_PROCESS, pid=pid))
        book.on_event(ev(S.GE_FIRST, pid=pid + 10))
    assert book.new_processes == {1, 2} and book.first_calls == {11, 12}
    book.on_event(ev(S.GE_BEGIN, capture=1, ts=1))
    book.on_event(ev(S.GE_NODE, capture=1, function=F))
    book.on_event(ev(S.GE_BEGIN, capture=2, ts=2))
    book.on_event(ev(S.GE_BEGIN, capture=3, ts=3))  # past the bound: not kept
    assert book.summary(PID)["captures_in_progress"] == 2
    book.on_event(ev(S.GE_BEGIN, capture=1, ts=4))  # begun again at the bound: a new capture
    book.on_event(ev(S.GE_NODE, capture=1, function=G))
    book.on_event(ev(S.GE_END, capture=1, graph=0xa, count=1, ts=5))
    # handles: two nodes of 0xa take the process's two; 0xb's node is not followed
    for node in (0x71, 0x72):
        book.on_event(ev(S.GE_ADD, graph=0xa, node=node, function=G))
    book.on_event(ev(S.GE_CREATE, graph=0xb))
    book.on_event(ev(S.GE_ADD, graph=0xb, node=0x73, function=F))
    book.on_event(ev(S.GE_SET, node=0x73, function=G))  # not followed: 0xb still runs F, known whole
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 0xb, 0xf, 1)
    book.account({(PID, 0xe): (1, 1), (PID, 0xf): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {G: 3, F: 1}
    assert book.summary(PID)["partial_content_launches"] == 0


def test_a_set_on_a_node_never_seen_leaves_the_graph_at_handle_1_alone():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=1))
    book.on_event(ev(S.GE_ADD, graph=1, node=0x71, function=F))
    book.on_event(ev(S.GE_SET, node=0x99, function=G))
    instantiate(book, 1, 0xe, 1)
    book.account({(PID, 0xe): (1, 1)})
    assert book.summary(PID)["partial_content_launches"] == 0


def test_lost_begins_are_kept_under_their_capture_and_end_as_their_own_graph():
    seen = []
    book = graphs.GraphBook(launches_seen=lambda begin, end: seen.append((begin, end)) or True)
    book.on_event(ev(S.GE_CREATE, graph=1))  # a graph at handle 1: nothing of the captures goes to it
    book.on_event(ev(S.GE_NODE, capture=5, function=F, dims=D))  # its begin lost
    book.on_event(ev(S.GE_END, capture=5, graph=0xa, count=1, ts=50))
    book.on_event(ev(S.GE_END, capture=7, graph=0xb, count=0, ts=70))  # begin lost, empty: complete
    assert seen == [(7, 70)]  # the first is partial already: its nodes came without their begin
    assert book.summary(PID)["graphs"] == 3
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 1, 0xf, 1)
    book.account({(PID, 0xe): (1, 2), (PID, 0xf): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F: 2}
    assert book.export(PID)["execs"] == [{"exec": 0xe, "complete": False, "nodes": [[F, *D, 0, 1]]},
                                         {"exec": 0xf, "complete": True, "nodes": []}]


def test_a_capture_into_a_graph_adds_each_node_and_into_one_never_seen_is_partial():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    book.on_event(ev(S.GE_BEGIN, capture=100, graph=0xa, ts=100))
    for _ in range(3):
        book.on_event(ev(S.GE_NODE, capture=100, function=F, dims=D))
    book.on_event(ev(S.GE_END, capture=100, graph=0xa, count=3, ts=110))
    # a graph made before the probe attached: what it held before the capture is unknown
    book.on_event(ev(S.GE_BEGIN, capture=200, graph=0x99, ts=200))
    book.on_event(ev(S.GE_NODE, capture=200, function=G, dims=D))
    book.on_event(ev(S.GE_END, capture=200, graph=0x99, count=1, ts=210))
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 0x99, 0xf, 1)
    book.account({(PID, 0xe): (1, 2), (PID, 0xf): (1, 1)})
    assert {f: v["launches"] for (_, f), v in book.kernels(PID).items()} == {F: 6, G: 1}
    s = book.summary(PID)
    assert (s["graphs"], s["partial_content_launches"]) == (2, 1)
    assert [x["complete"] for x in book.export(PID)["execs"]] == [True, False]


def test_a_graph_added_to_before_the_probe_is_exported_as_not_complete():
    book = graphs.GraphBook()
    book.on_event(ev(S.GE_ADD, graph=0xa, node=0x71, function=F, dims=D))
    book.on_event(ev(S.GE_SET, node=0x72, function=G, dims=D))  # no effect: never seen
    book.on_event(ev(S.GE_CREATE, graph=0xb))
    book.on_event(ev(S.GE_ADD, graph=0xb, node=0x73, function=F, dims=D))
    instantiate(book, 0xa, 0xe, 1)
    instantiate(book, 0xb, 0xf, 1)
    book.on_event(ev(S.GE_SET, exec=0xf, serial=1, node=0x74, function=G, dims=D))  # a node never seen
    assert book.export(PID)["execs"] == [{"exec": 0xe, "complete": False, "nodes": [[F, *D, 0, 1]]},
                                         {"exec": 0xf, "complete": False, "nodes": [[F, *D, 0, 1]]}]


# ---- what a later probe is told (trace.graphs), and takes --------------------------------------
N1, N2 = (F, 4, 1, 1, 32, 1, 1, 0), (G, 1, 1, 1, 64, 1, 1, 128)


def test_export_gives_the_newest_known_executable_graphs_in_order_and_preload_counts_them():
    book = graphs.GraphBook()
    assert book.export(PID) == {"execs": [], "truncated": False}
    book.on_event(ev(S.GE_CREATE, graph=0xa))
    for node, (f, *dims, shared) in ((0x71, N2), (0x72, N1), (0x73, N1)):
        book.on_event(ev(S.GE_ADD, graph=0xa, node=node, function=f, dims=dims, shared_mem=shared))
    capture(book, 100, 0xb, [G], count=2)  # a node lost: partial
    instantiate(book, 0xb, 0xe, 1)
    instantiate(book, 0xa, 0xe, 3)  # the same address, newer: this one is exported
    instantiate(book, 0xb, 0xd, 2)
    instantiate(book, 0x99, 0xc, 4)  # content unknown: not exported
    want = {"execs": [{"exec": 0xd, "complete": False, "nodes": [[G, 4, 1, 1, 32, 1, 1, 0, 1]]},
                      {"exec": 0xe, "complete": True, "nodes": [list(N1) + [2], list(N2) + [1]]}],
            "truncated": False}
    assert book.export(PID) == want
    # a probe attached later is told, and counts their replays with that content
    later = graphs.GraphBook()
    assert later.preload(PID, want["execs"] + [{"exec": 0xd, "complete": True, "nodes": []}]) == 2
    later.account({(PID, 0xe): (0, 3), (PID, 0xd): (0, 2), (PID, 0xc): (0, 1)})
    k = later.kernels(PID)
    assert k == {(PID, F): {"launches": 6, "degenerate_launches": 0, "grid": [4, 1, 1], "block": [32, 1, 1],
                            "shared_mem_bytes": 0},
                 (PID, G): {"launches": 5, "degenerate_launches": 3, "grid": [1, 1, 1], "block": [64, 1, 1],
                            "shared_mem_bytes": 128}}
    assert later.per_process()[PID] == (11, {"known": 3, "partial": 2, "unknown": 1})
    # and exports them in turn, as of serial 0
    assert later.export(PID) == {"execs": [dict(x) for x in want["execs"]], "truncated": False}


def test_export_keeps_the_newest_even_when_an_older_one_came_later():
    book = graphs.GraphBook()
    book.preload(PID, [{"exec": 0xe, "complete": True, "nodes": [list(N1) + [1]]}])
    capture(book, 100, 0xa, [G])
    instantiate(book, 0xa, 0xe, 3)
    book.account({(PID, 0xe): (0, 1)})  # the one made before the probe, seen after the newer one
    assert book.export(PID)["execs"] == [{"exec": 0xe, "complete": True, "nodes": [[G, 4, 1, 1, 32, 1, 1, 0, 1]]}]


def test_export_leaves_out_what_goes_past_max_nodes_and_goes_on_with_smaller_ones():
    book = graphs.GraphBook()
    for exec_, n in ((1, 2), (2, 3), (3, 1), (4, 1)):
        capture(book, 100 * exec_, 0xa0 + exec_, [F + i for i in range(n)])
        instantiate(book, 0xa0 + exec_, exec_, 1)
    out = book.export(PID, max_nodes=3)
    assert [x["exec"] for x in out["execs"]] == [1, 3] and out["truncated"] is True
    assert book.export(PID, max_nodes=7) == {"execs": book.export(PID)["execs"], "truncated": False}


def test_preload_is_bounded_and_refused_for_a_process_not_followed(monkeypatch):
    monkeypatch.setattr(graphs, "MAX_GRAPHS_PER_PROCESS", 2)
    book = graphs.GraphBook()
    x = [{"exec": e, "complete": True, "nodes": [list(N1) + [1]]} for e in (1, 1, 2, 3)]
    assert book.preload(PID, x) == 2  # the second 1 is taken already; 3 is past the bound
    book.account({(PID, 1): (0, 1), (PID, 2): (0, 1), (PID, 3): (0, 1)})
    # 3 was not told, and has no room as an executable graph of its own: counted as not followed
    assert book.per_process()[PID] == (2, {"known": 2}) and book.overflow == 1
    monkeypatch.setattr(graphs, "MAX_PROCESSES", 1)
    assert book.preload(PID + 1, x) == 0 and book.overflow == 2


# ---- GraphFollower: the ring drained by its thread, on a ring buffer of records handed in ----------
class FakeRing:
    """bpfsys.RingBuffer's consumer side: records pushed by the test, wait() ends on them or on wake()."""

    def __init__(self, fd: int, size: int, on_record) -> None:
        self.args, self.on_record = (fd, size), on_record
        self.records: list[bytes] = []
        self.waits: list[int] = []
        self.woken = self.closed = False
        self.cv = threading.Condition()

    def push(self, *records: bytes) -> None:
        with self.cv:
            self.records += records
            self.cv.notify_all()

    def wait(self, timeout_ms: int) -> bool:
        with self.cv:
            self.waits.append(timeout_ms)
            self.cv.notify_all()
            return self.cv.wait_for(lambda: self.records or self.woken, timeout_ms / 1000)

    def consume(self) -> int:
        with self.cv:
            records, self.records = self.records, []
        for r in records:
            self.on_record(r)
        return len(records)

    def wake(self) -> None:
        with self.cv:
            self.woken = True
            self.cv.notify_all()

    def close(self) -> None:
        self.closed = True


class Calls:
    def __init__(self) -> None:
        self.seen: list = []
        self.cv = threading.Condition()

    def add(self, what) -> None:
        with self.cv:
            self.seen.append(what)
            self.cv.notify_all()

    def until(self, n: int) -> list:
        with self.cv:
            self.cv.wait_for(lambda: len(self.seen) >= n, 2)
            return list(self.seen)


@pytest.fixture
def follower(monkeypatch):
    monkeypatch.setattr(graphs.bpfsys, "RingBuffer", FakeRing)
    made = []

    def make(book, **callbacks):
        made.append(graphs.GraphFollower((7, 4096), book, **callbacks))
        return made[-1]
    yield make
    for f in made:
        f.stop()


def test_the_follower_calls_back_for_first_calls_new_processes_and_captures_in_that_order(follower):
    book, calls = graphs.GraphBook(), Calls()
    f = follower(book, on_capture=lambda: calls.add("capture"), on_processes=lambda p: calls.add(("new", p)),
                 on_first_calls=lambda p: calls.add(("first", p)))
    ring = f._ring
    assert ring.args == (7, 4096) and ring.on_record == book.on_event
    [t] = [t for t in threading.enumerate() if t.name == "gpuwatch-ebpf-graphs"]
    assert t.daemon
    ring.push(ev(S.GE_BEGIN, capture=1), ev(S.GE_PROCESS, pid=5), ev(S.GE_FIRST, pid=6), ev(S.GE_FIRST, pid=8))
    assert calls.until(3) == [("first", {6, 8}), ("new", {5}), "capture"]
    ring.push(ev(S.GE_BEGIN, capture=2))  # a capture alone: no empty sets handed on
    assert calls.until(4)[3:] == ["capture"]
    ring.push(ev(S.GE_PROCESS, pid=9))  # a process alone: no capture said
    ring.push(ev(S.GE_NODE, capture=2, function=F))
    assert calls.until(5)[4:] == [("new", {9})]
    ring.push(ev(S.GE_FIRST, pid=10))
    assert calls.until(6)[5:] == [("first", {10})]
    assert set(ring.waits) == {graphs.GraphFollower.POLL_MS}
    assert book.new_processes == set() and book.first_calls == set()
    f.account(lambda: {(PID, 0xe): (0, 3)})
    assert f.read(lambda b: b.summary(PID)["launches"]) == 3


def test_the_follower_waits_again_after_a_quiet_poll(follower):
    calls = Calls()
    f = follower(graphs.GraphBook(), on_capture=lambda: calls.add("capture"))
    ring = f._ring
    with ring.cv:
        ring.cv.wait_for(lambda: len(ring.waits) >= 2, 2)  # one wait timed out, and it waits again
    ring.push(ev(S.GE_BEGIN, capture=1))
    assert calls.until(1) == ["capture"]


class RecordingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list = []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return super().wait(0)


def test_a_failing_callback_is_said_and_the_follower_goes_on_after_a_pause(follower, caplog):
    calls, fails = Calls(), [RuntimeError("boom")]

    def on_capture():
        if fails:
            raise fails.pop()
        calls.add("capture")
    f = follower(graphs.GraphBook(), on_capture=on_capture)
    f._stop = RecordingEvent()  # its pause, recorded rather than waited out
    caplog.set_level(logging.WARNING, logger="gpuwatch.ebpf")
    f._ring.push(ev(S.GE_BEGIN, capture=1))
    f._ring.push(ev(S.GE_BEGIN, capture=2))  # may come with the first; then a third one is needed
    with f._ring.cv:
        f._ring.cv.wait_for(lambda: not f._ring.records, 2)
    f._ring.push(ev(S.GE_BEGIN, capture=3))
    assert calls.until(1)[0] == "capture"
    assert [r.getMessage() for r in caplog.records if r.name == "gpuwatch.ebpf"] == \
        ["following CUDA graphs: RuntimeError: boom"]
    assert f._stop.waits == [1.0]


def test_stop_ends_the_thread_within_its_bound_and_nothing_is_called_after(follower):
    calls = Calls()
    book = graphs.GraphBook()
    f = follower(book, on_capture=lambda: calls.add("capture"))
    thread, joins = f._thread, []

    class Joined:
        def join(self, timeout=None):
            joins.append(timeout)
            thread.join(timeout)
    f._thread = Joined()
    f.stop()
    assert joins == [2 * graphs.GraphFollower.POLL_MS / 1000 + 1] and not thread.is_alive()
    assert f._ring.closed and calls.seen == []
    f._ring.push(ev(S.GE_BEGIN, capture=1))
    f.account(lambda: {(PID, 0xe): (0, 3)})  # stopped: nothing taken
    assert f._ring.records and book.summary()["launches"] == 0

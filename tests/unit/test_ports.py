"""The tests' ports (``tests/ports.py``): below the kernel's ephemeral range, one slice per
pytest-xdist worker, none handed out twice in a row."""

from __future__ import annotations

import socket

from tests import ports


def test_worker_slices_are_disjoint_and_below_the_ephemeral_range():
    env = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    gw0 = ports.worker_ports({**env, "PYTEST_XDIST_WORKER": "gw0"}, ephemeral_low=32768)
    gw1 = ports.worker_ports({**env, "PYTEST_XDIST_WORKER": "gw1"}, ephemeral_low=32768)
    assert (gw0.start, gw0.stop, gw1.start, gw1.stop) == (20000, 26384, 26384, 32768)
    assert ports.worker_ports({}, ephemeral_low=32768) == range(20000, 32768)  # no xdist
    assert ports.worker_ports({}, ephemeral_low=20050) == range(0)  # no room: the kernel's pick


def test_free_port_hands_out_distinct_bindable_ports_outside_the_ephemeral_range():
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(5)]
    assert len(set(picked)) == 5
    assert all(p in ports._PORTS for p in picked) and all(p < low for p in picked)
    with socket.socket() as held:  # a port something holds is skipped
        nxt = ports._PORTS[ports._turn % len(ports._PORTS)]
        held.bind(("", nxt))
        held.listen()
        assert ports.free_port() != nxt

"""Ports picked for a server another process binds later (runbase.net.free_port)."""
import socket

from runbase import net


def test_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path):
    low = net.ephemeral_low()
    for _ in range(20):
        port = net.free_port()
        assert net.PORT_BAND[0] <= port < min(net.PORT_BAND[1], low)
        with socket.socket() as s:  # free: the caller's server can take it
            s.bind((net.LOOPBACK, port))


def test_free_port_leaves_the_pick_to_the_kernel_when_the_band_is_ephemeral(tmp_path, monkeypatch):
    ranges = tmp_path / "range"
    ranges.write_text("1024\t65535\n")  # every port ephemeral: no band is safe
    assert net.ephemeral_low(str(ranges)) == 1024
    monkeypatch.setattr(net, "ephemeral_low", lambda: 1024)
    port = net.free_port()
    assert port > 0
    with socket.socket() as s:
        s.bind((net.LOOPBACK, port))


def test_an_unreadable_range_reads_as_linuxs_default(tmp_path):
    assert net.ephemeral_low(str(tmp_path / "missing")) == 32768
    bad = tmp_path / "bad"
    bad.write_text("")
    assert net.ephemeral_low(str(bad)) == 32768


def test_free_ports_do_not_follow_the_random_modules_seed():
    """Processes whose libraries seed `random` alike (vLLM, TRL) must not draw the same ports."""
    import random

    draws = []
    for _ in range(2):
        random.seed(0)
        draws.append([net.free_port() for _ in range(3)])
    assert draws[0] != draws[1]

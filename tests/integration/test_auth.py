"""No open doors off loopback (runbase/net.py): a real redis-server and a real ingest bound to
127.0.0.2, which the rule counts as reachable by others (anything but 127.0.0.1/localhost).
A client without the run's password is refused by Redis; a ZeroMQ client without the run's CURVE
keys, or with keys of its own, gets no ack and stores nothing. The keyed client is served."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import redis
import zmq

from buffer.ingest import IngestServer
from buffer.schema import Limits, encode
from cluster.redis_local import LocalRedis
from runbase import net
from runbase.keys import Keys, connect
from tests.integration.test_buffer import make_group

HOST = "127.0.0.2"     # a second loopback address: off 127.0.0.1, so auth is required
NO_ACK_WAIT_MS = 1500  # an authenticated client on this machine gets its ack in milliseconds


@pytest.fixture
def secrets(monkeypatch):
    made = net.new_secrets()
    for k, v in made.items():
        monkeypatch.setenv(k, v)
    return made


@pytest.fixture
def secure_redis(tmp_path, secrets):
    assert net.needs_auth(HOST, insecure=False)
    server = LocalRedis(tmp_path / "redis", host=HOST, password=secrets[net.ENV_REDIS_PASSWORD])
    yield server
    server.stop()


def test_rule_anything_but_loopback_needs_auth():
    assert not net.needs_auth("127.0.0.1", insecure=False) and not net.needs_auth("localhost", insecure=False)
    assert net.needs_auth("127.0.0.2", insecure=False) and net.needs_auth("10.1.2.3", insecure=False)
    assert not net.needs_auth("10.1.2.3", insecure=True)  # the operator's explicit opt-out
    assert net.resolve_bind_host("auto", 1) == "127.0.0.1" and net.resolve_bind_host("auto", 2) == net.NODE


def test_redis_off_loopback_refuses_a_client_without_the_password(secure_redis, secrets):
    assert secure_redis.url.startswith(f"redis://{HOST}:")
    with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
        redis.Redis(host=HOST, port=secure_redis.port).set("x", 1)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host=HOST, port=secure_redis.port, password="guess").ping()
    assert connect(secure_redis.url).ping()  # runbase.keys.connect takes the password from the environment
    # the password reached the server on stdin: not in its command line (visible to every user in ps)
    cmdline = Path(f"/proc/{secure_redis.proc.pid}/cmdline").read_bytes()
    assert secrets[net.ENV_REDIS_PASSWORD].encode() not in cmdline
    assert secrets[net.ENV_REDIS_PASSWORD] not in secure_redis.url


def test_ingest_off_loopback_acks_only_curve_clients_with_the_run_key(secure_redis, secrets, run_id):
    from actors.sender import ZmqTrajectorySink

    keys = Keys(run_id)
    r = connect(secure_redis.url)
    server = IngestServer(r, keys, Limits(vocab_size=100), host=HOST)
    stop = threading.Event()
    t = threading.Thread(target=server.serve, kwargs={"should_stop": stop.is_set}, daemon=True)
    t.start()
    try:
        assert server.address.startswith(f"tcp://{HOST}:")
        announced = r.hgetall(keys.ingest)
        assert announced[b"curve_public"].decode() == secrets[net.ENV_CURVE_SERVER_PUBLIC]

        def no_reply(configure) -> bool:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            # a DEALER's send blocks while it has no peer: the server drops a refused handshake's pipe, and a
            # send in that window (before the reconnect) would wait forever. Bounded, it fails with Again:
            # nothing was even queued to the server, which then has nothing to answer (still checked below)
            s.setsockopt(zmq.SNDTIMEO, NO_ACK_WAIT_MS)
            configure(s)
            s.connect(server.address)
            try:
                s.send(encode(make_group("g-intruder")))
            except zmq.Again:
                pass
            silent = not s.poll(NO_ACK_WAIT_MS)
            s.close(0)
            ctx.term()
            return silent

        assert no_reply(lambda s: None), "a plain (NULL mechanism) client got an answer"

        def own_keys(s):  # right server key, but a client key the run never issued
            pub, sec = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = announced[b"curve_public"], pub, sec

        assert no_reply(own_keys), "a client with an unknown CURVE key got an answer"
        assert r.xlen(keys.traj) == 0 and server.accepted == 0

        sink = ZmqTrajectorySink(server.address, Limits(vocab_size=100), server_public=announced[b"curve_public"])
        try:
            assert sink.send([make_group("g-run")]) == [None]  # acked
        finally:
            sink.close()
        assert r.xlen(keys.traj) == 1 and server.accepted == 1
    finally:
        stop.set()
        t.join(5)
        server.close()
        r.close()


def test_one_node_keeps_gloo_and_nccl_sockets_on_loopback():
    copied = {net.VLLM_COPY_ENV: "GLOO_SOCKET_IFNAME,NCCL_SOCKET_IFNAME"}   # vLLM's Ray workers get them too
    assert net.interface_env("127.0.0.1", {}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", **copied}
    assert net.interface_env("127.0.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": "lo", **copied}
    assert net.interface_env("127.0.0.1", {net.VLLM_COPY_ENV: "MY_VAR"})[net.VLLM_COPY_ENV] == \
        "GLOO_SOCKET_IFNAME,MY_VAR,NCCL_SOCKET_IFNAME"   # the operator's list kept
    assert net.interface_env("10.1.2.3", {}) == {}  # several nodes: their interfaces


@pytest.mark.parametrize("host", ["127.0.0.1", HOST])
def test_torch_stores_listen_only_on_their_host(host):
    """A master TCPStore given a host still binds every interface; ours listens on exactly that address."""
    from datetime import timedelta

    import psutil

    from weightsync.store import client_store, master_store

    timeout = timedelta(seconds=5)
    store = master_store(host, 0, timeout)
    listening = {c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert [a.ip for a in listening if a.port == store.port] == [host]
    client_store(host, store.port, timeout).set("k", "v")  # and clients reach it there
    assert store.get("k") == b"v"
    with pytest.raises(OSError, match=f"cannot listen on {host}:{store.port}"):  # its port, taken: named
        master_store(host, store.port, timeout)


def test_a_redis_off_loopback_gets_a_port_free_on_loopback_too(tmp_path, secrets, monkeypatch):
    """A local Redis bound off loopback also binds 127.0.0.1 on the same port (the launcher's own connection): its
    port must be free on both. Picked free on its host alone, a port some server held on 127.0.0.1 only (another
    job's local Redis, in the same band) made redis-server exit at start. The first draw is made that port."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", net.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        real, draws = net._PORT_DRAW.randrange, []
        monkeypatch.setattr(net._PORT_DRAW, "randrange",
                            lambda *a: draws.append(a) or (taken if len(draws) == 1 else real(*a)))
        server = LocalRedis(tmp_path / "redis", host=HOST, password=secrets[net.ENV_REDIS_PASSWORD])
        try:
            assert server.port != taken and len(draws) >= 2
            assert connect(server.url).ping()
        finally:
            server.stop()

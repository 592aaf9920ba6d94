"""Where a process listens, and the per-run secrets that guard anything listening off loopback.

Single-node runs bind every server (Redis, ingest, learner rendezvous, weight-sync store, gloo and
NCCL sockets) to 127.0.0.1; multi-node runs bind the node's routable IP and announce it through Redis. The rule
for authentication is simple on purpose: any host other than 127.0.0.1/localhost is treated as
reachable by others, so Redis then requires a password and the ingest ZeroMQ CURVE, both
generated per run and handed to processes only through the environment (never logged, never
in job.json/status.json/config.yaml), unless the operator opts out with `cluster.insecure=true`.
"""
from __future__ import annotations

import logging
import os
import random
import secrets
import socket

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
NODE = "node"  # bind_host value: this node's routable IP, resolved in each process on its own node

# Environment variables carrying the run's secrets to every process (set as each starts: cluster.proc.Proc).
ENV_REDIS_PASSWORD = "ASYNCRL_REDIS_PASSWORD"
ENV_CURVE_SERVER_PUBLIC = "ASYNCRL_CURVE_SERVER_PUBLIC"  # ingest's public key (also announced in Redis)
ENV_CURVE_SERVER_SECRET = "ASYNCRL_CURVE_SERVER_SECRET"
ENV_CURVE_CLIENT_PUBLIC = "ASYNCRL_CURVE_CLIENT_PUBLIC"
ENV_CURVE_CLIENT_SECRET = "ASYNCRL_CURVE_CLIENT_SECRET"
SECRET_ENV = (ENV_REDIS_PASSWORD, ENV_CURVE_SERVER_PUBLIC, ENV_CURVE_SERVER_SECRET,
              ENV_CURVE_CLIENT_PUBLIC, ENV_CURVE_CLIENT_SECRET)
PASSWORD_BYTES = 32  # 256 bits from `secrets`: not guessable over a network
LISTEN_BACKLOG = 512  # pending connections a store's socket queues: every rank and actor may dial at once
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
# gloo's pair listeners bind the hostname's address and NCCL's bootstrap sockets the first non-loopback
# interface unless these name one: on a one-node job they must stay on loopback like every other server
IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
VLLM_COPY_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"   # what vLLM's Ray executor passes on to its workers
# A port chosen now and bound later by another process (Redis, a learner rendezvous) is picked below the
# kernel's ephemeral range, where no process's outgoing connection can take it in between (CI lost a job
# to that: EADDRINUSE at the learner's bind); above Ray's default worker ports (10002-19999)
PORT_BAND = (20000, 32768)
PORT_TRIES = 64  # random draws in the band before leaving the pick to the kernel (a band nearly full)
# Draws from the OS's entropy, not the `random` module's shared state: a process whose libraries seeded that (vLLM's
# engine, TRL's trainer: random.seed of a fixed seed) drew the same ports as every other process seeded alike, and two
# such processes starting servers at once could meet on one port (two test workers' rank groups, say)
_PORT_DRAW = random.SystemRandom()
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def is_loopback(host: str) -> bool:
    """Only 127.0.0.1/localhost count as private: any other address (127.0.0.2 included) needs auth."""
    return host in LOOPBACK_NAMES


def resolve_bind_host(setting: str, n_nodes: int) -> str:
    """The launcher's decision, passed to every process: `auto` is loopback on a one-node Ray and
    `node` (each process's own node IP) on several; anything else is used as given."""
    if setting == "auto":
        return LOOPBACK if n_nodes <= 1 else NODE
    return setting


def local_host(bind_host: str) -> str:
    """The address this process binds and announces, for a resolved `cluster.bind_host`."""
    if bind_host == "auto":  # not resolved by a launcher (a standalone process): stay private
        return LOOPBACK
    if bind_host != NODE:
        return bind_host
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (a standalone ingest): the address the default route uses
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1, nothing is sent: only picks the outgoing interface
            return s.getsockname()[0]


def ephemeral_low(path: str = EPHEMERAL_RANGE) -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default when unreadable)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(hosts, port: int) -> bool:
    """Whether `port` can be bound on every one of `hosts` now (each checked, then released)."""
    for host in hosts:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port(host: str = LOOPBACK, *also: str) -> int:
    """A port free on `host` (and on every address in `also`: a server that binds several, like a local Redis off
    loopback that binds 127.0.0.1 too) now, for a server another process starts later: drawn from PORT_BAND below
    the ephemeral range (only another listener could take it meanwhile), else the kernel's pick; OSError when no
    port is free on all of them in PORT_TRIES draws of each kind."""
    low, high = PORT_BAND[0], min(PORT_BAND[1], ephemeral_low())
    hosts = (host, *also)
    for _ in range(PORT_TRIES if high > low else 0):
        port = _PORT_DRAW.randrange(low, high)
        if _bindable(hosts, port):
            return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(PORT_TRIES):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if _bindable(also, port):
            return port
    raise OSError(f"no port free on all of {', '.join(hosts)} in {PORT_TRIES} tries")


def bound_listener(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket bound to exactly `host` (a torch TCPStore given only a host name binds every
    interface; handed this socket's descriptor it listens where we say). Port 0: any free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted rank 0 rebinds its port at once
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def interface_env(host: str, environ) -> dict[str, str]:
    """Variables that keep gloo and NCCL sockets on loopback when this job's servers bind `host` there
    (a one-node job); a multi-node job keeps its interfaces, and a value the operator set wins."""
    if not is_loopback(host):
        return {}
    env = {k: LOOPBACK_IFNAME for k in IFNAME_ENV if not environ.get(k)}
    # vLLM's Ray executor (tensor parallel in a placement group) gives its workers only the variables it copies
    # (VLLM_*, NCCL_*, ...): GLOO_SOCKET_IFNAME is added to the operator's list
    extra = {x for x in environ.get(VLLM_COPY_ENV, "").split(",") if x}
    env[VLLM_COPY_ENV] = ",".join(sorted(extra | set(IFNAME_ENV)))
    return env


def needs_auth(bind_host: str, insecure: bool) -> bool:
    """Whether servers bound at `bind_host` must authenticate clients. `node` is never loopback."""
    return not insecure and not is_loopback(bind_host)


def warn_insecure(bind_host: str) -> None:
    msg = (f"cluster.insecure=true: Redis and the ingest listen on {bind_host} WITHOUT authentication; "
           "anyone who can reach this network can read and inject trajectories")
    log.warning(msg)
    print(f"WARNING: {msg}", flush=True)


def new_secrets() -> dict[str, str]:
    """A Redis password and CURVE keypairs (ingest server, actor clients) for one run, as env vars."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {ENV_REDIS_PASSWORD: secrets.token_urlsafe(PASSWORD_BYTES),
            ENV_CURVE_SERVER_PUBLIC: server_public.decode(), ENV_CURVE_SERVER_SECRET: server_secret.decode(),
            ENV_CURVE_CLIENT_PUBLIC: client_public.decode(), ENV_CURVE_CLIENT_SECRET: client_secret.decode()}


def run_secrets() -> dict[str, str]:
    """This process's share of the run's secrets (empty when the run needs none)."""
    return {k: os.environ[k] for k in SECRET_ENV if os.environ.get(k)}


def curve_server(sock) -> tuple[object | None, str | None]:
    """Make a ROUTER a CURVE server admitting only the run's client key; returns the ZAP authenticator
    (keep it alive, stop it on close) and the server's public key to announce, or (None, None) when
    this process holds no CURVE keys (a loopback run)."""
    env = run_secrets()
    if ENV_CURVE_SERVER_SECRET not in env:
        return None, None
    from zmq.auth.thread import ThreadAuthenticator

    allowed = env[ENV_CURVE_CLIENT_PUBLIC].encode()

    class _OnlyRunClients:
        def callback(self, domain, key):  # the client's public key, z85-encoded
            return key == allowed

    auth = ThreadAuthenticator(sock.context, log=logging.getLogger("zmq.auth"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_OnlyRunClients())
    sock.curve_server = True
    sock.curve_publickey = env[ENV_CURVE_SERVER_PUBLIC].encode()
    sock.curve_secretkey = env[ENV_CURVE_SERVER_SECRET].encode()
    return auth, env[ENV_CURVE_SERVER_PUBLIC]


def curve_client(sock, server_public: bytes | None) -> None:
    """Make a DEALER a CURVE client of the ingest when the run has keys (no-op on loopback runs)."""
    env = run_secrets()
    if ENV_CURVE_CLIENT_SECRET not in env or not server_public:
        return
    sock.curve_serverkey = server_public
    sock.curve_publickey = env[ENV_CURVE_CLIENT_PUBLIC].encode()
    sock.curve_secretkey = env[ENV_CURVE_CLIENT_SECRET].encode()

"""The soak's own network (tests/chaos/soak.py): the run's Redis server, started by the soak so that it outlives
each of the run's incarnations (a learner fault ends a job; `--resume` starts the next against the same books),
reached by the job only through a LoopbackProxy that can cut every connection at once; and a proxy in front of
each ingest shard, put in the place of the address the shard announces in Redis, so the links from actors to the
ingest can be cut too."""
from __future__ import annotations

import threading
from pathlib import Path

from proxy import LoopbackProxy

from cluster.redis_local import LocalRedis
from runbase.keys import Keys, connect

INGEST_WATCH_S = 0.05  # the proxy takes an announced ingest's place this soon; actors look for a moved ingest
                       # once a second (actors/sender.py ADDRESS_CHECK_S), so nearly always find the proxy's address
ANNOUNCED = "address:"  # the ingest's hash fields, one per shard (buffer/ingest.py); shard 0 also as `address`

# The field still holds what the ingest announced (not a newer ingest's address): only then the proxy's goes in.
SWAP_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[1] == 'address:0' then redis.call('HSET', KEYS[1], 'address', ARGV[3]) end
return 1
"""


class IngestLinks:
    """A thread that puts a LoopbackProxy in front of every ingest shard the run announces, a new one for each
    address (a restarted ingest binds a new port); `drop()` cuts every actor's link through them."""

    def __init__(self, r, keys: Keys):
        self.r, self.keys = r, keys
        self.proxies: dict[str, LoopbackProxy] = {}   # field -> the proxy in its place
        self.retired = 0                              # connections cut by drop() on proxies since replaced
        self.error: BaseException | None = None      # what stopped the watch (the soak fails on it)
        self.stop = threading.Event()
        threading.Thread(target=self.run, name="ingest-links", daemon=True).start()

    def run(self) -> None:
        try:
            self._watch()
        except BaseException as e:   # a thread's exception is otherwise only printed: the soak asserts on it
            self.error = e

    def _watch(self) -> None:
        import redis

        while not self.stop.wait(INGEST_WATCH_S):
            try:
                fields = self.r.hgetall(self.keys.ingest)
            except redis.ConnectionError:   # the soak's own kill_redis: its client retries; look again next time
                continue
            for field, value in fields.items():
                field, value = field.decode(), value.decode()
                mine = self.proxies.get(field)
                if field.startswith(ANNOUNCED) and (mine is None or value != f"tcp://{mine.address}"):
                    self._proxy(field, value)

    def _proxy(self, field: str, announced: str) -> None:
        host, port = announced.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1", f"the soak proxies loopback ingests only; {field} announced {announced}"
        proxy = LoopbackProxy(int(port))
        if not self.r.eval(SWAP_LUA, 1, self.keys.ingest, field, announced, f"tcp://{proxy.address}"):
            proxy.close()   # a newer ingest announced itself meanwhile: the next look proxies that one
            return
        if old := self.proxies.get(field):
            self.retired += old.dropped
            old.close()
        self.proxies[field] = proxy

    def drop(self) -> int:
        return sum(p.drop() for p in list(self.proxies.values()))

    def cut(self) -> int:
        """Connections cut by drop() over the soak."""
        return self.retired + sum(p.dropped for p in list(self.proxies.values()))

    def close(self) -> None:
        self.stop.set()
        for p in list(self.proxies.values()):
            p.close()


class SoakNet:
    """The run's Redis server, its proxy (the job's `--redis-url`), a direct client, and the ingest links."""

    def __init__(self, data_dir: Path, run_id: str):
        self.server = LocalRedis(data_dir)
        self.redis_proxy = LoopbackProxy(self.server.port)
        self.url = f"redis://{self.redis_proxy.address}/0"   # what the job's processes dial
        self.r = connect(self.server.url)                     # the soak's own client: never cut by drop_redis
        self.ingest = IngestLinks(self.r, Keys(run_id))

    def kill_redis(self) -> None:
        """SIGKILL of the server, then a start on the same port from its AOF (as the launcher's watchdog does
        for a job's own server): with `appendfsync always` every acknowledged write is in it."""
        self.server.proc.kill()
        self.server.proc.wait()
        self.server.restart()

    def close(self) -> None:
        self.ingest.close()
        self.redis_proxy.close()
        self.server.stop()

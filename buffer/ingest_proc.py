"""The ingest as a process: connect to Redis, serve until the run's stop flag is set."""
from __future__ import annotations

from buffer.schema import Limits


class IngestProcess:
    def __init__(self, cfg, *, run_id: str, redis_url: str, vocab_size: int | None = None, shard: int = 0):
        from buffer.ingest import IngestServer
        from buffer.store import Keys, connect
        from cluster.net import local_host

        self.keys = Keys(run_id)
        self.r = connect(redis_url)
        b = cfg.buffer
        limits = Limits(vocab_size=vocab_size, max_response_tokens=b.max_response_tokens,
                        max_message_bytes=b.max_message_bytes)
        port = b.ingest_port + shard if b.ingest_port else 0
        self.server = IngestServer(self.r, self.keys, limits, host=local_host(cfg.cluster.bind_host), port=port,
                                   deadletter_maxlen=b.deadletter_maxlen, shard=shard)

    def run(self) -> dict:
        try:
            self.server.serve(should_stop=lambda: bool(self.r.exists(self.keys.stop_ingest)))
        finally:
            self.server.close()
        return {"accepted": self.server.accepted, "rejected": self.server.rejected}


def main(argv=None) -> int:
    """python -m buffer.ingest_proc --redis-url U --run-id R [--vocab-size V] [overrides...]:
    one ingest server as its own process (the launcher normally starts it under Ray)."""
    import argparse
    import logging

    p = argparse.ArgumentParser(prog="python -m buffer.ingest_proc")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--shard", type=int, default=0, help="which of buffer.ingest_shards this server is")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ingest %(levelname)s %(message)s")
    from cluster.config import load_config

    proc = IngestProcess(load_config(None, args.overrides), run_id=args.run_id, redis_url=args.redis_url,
                         vocab_size=args.vocab_size, shard=args.shard)
    print(proc.server.address, flush=True)
    proc.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ingest as a process: connect to Redis, serve until the run's stop flag is set.

It is handed its own configuration (the buffer's section and the interface to listen on) and the job's
numbers as plain values: the buffer never reads the root config, which belongs to the launcher above it."""
from __future__ import annotations

from buffer.config import BufferConfig
from buffer.ingest import IngestServer
from buffer.schema import Limits
from runbase.configload import ConfigError, from_dict, parse_override, set_dotted
from runbase.keys import Keys, connect, mark_startup
from runbase.net import local_host


def job_limits(b: BufferConfig, *, vocab_size: int | None = None, max_prompt_tokens: int | None = None,
               max_response_tokens: int | None = None, max_positions: int | None = None,
               group_size: int | None = None) -> Limits:
    """What the ingest accepts: the buffer's own bounds, narrowed by the job's numbers (the launcher
    passes the model's vocabulary and positions, data.max_prompt_length, actors.max_tokens and actors.n)."""
    default = Limits()
    return Limits(vocab_size=vocab_size, max_positions=max_positions, group_size=group_size,
                  max_prompt_tokens=min(default.max_prompt_tokens, max_prompt_tokens or default.max_prompt_tokens),
                  max_response_tokens=min(b.max_response_tokens, max_response_tokens or b.max_response_tokens),
                  max_message_bytes=b.max_message_bytes, min_reward=b.min_reward, max_reward=b.max_reward)


class IngestProcess:
    def __init__(self, buffer: BufferConfig, *, bind_host: str, run_id: str, redis_url: str,
                 vocab_size: int | None = None, max_prompt_tokens: int | None = None,
                 max_response_tokens: int | None = None, max_positions: int | None = None, shard: int = 0,
                 group_size: int | None = None):
        import logging

        self.keys, self.shard = Keys(run_id), shard
        self.r = connect(redis_url)
        limits = job_limits(buffer, vocab_size=vocab_size, max_prompt_tokens=max_prompt_tokens,
                            max_response_tokens=max_response_tokens, max_positions=max_positions,
                            group_size=group_size)
        logging.getLogger(__name__).info(
            "ingest limits: vocab %s, prompt <= %d tokens, response <= %d, prompt + response <= %s positions, "
            "reward in [%g, %g], message <= %d bytes, %s samples a group", vocab_size, limits.max_prompt_tokens,
            limits.max_response_tokens, max_positions, limits.min_reward, limits.max_reward, limits.max_message_bytes,
            group_size)
        port = buffer.ingest_port + shard if buffer.ingest_port else 0
        self.server = IngestServer(self.r, self.keys, limits, host=local_host(bind_host), port=port,
                                   deadletter_maxlen=buffer.deadletter_maxlen, shard=shard)

    def run(self) -> dict:
        mark_startup(self.r, self.keys, f"ingest-{self.shard}", "listening")
        try:
            self.server.serve(should_stop=lambda: bool(self.r.exists(self.keys.stop_ingest)))
        finally:
            self.server.close()
        return {"accepted": self.server.accepted, "rejected": self.server.rejected,
                "peers_dropped": self.server.peers_dropped}


def main(argv=None) -> int:
    """python -m buffer.ingest_proc --redis-url U --run-id R [--vocab-size V] [--max-prompt-tokens P]
    [--max-response-tokens T] [--max-positions N] [--bind-host H] [buffer.KEY=VALUE ...]: one ingest server
    as its own process (the launcher normally starts it under Ray, with the job's numbers)."""
    import argparse
    import logging

    p = argparse.ArgumentParser(prog="python -m buffer.ingest_proc")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--max-prompt-tokens", type=int, help="the job's data.max_prompt_length")
    p.add_argument("--max-response-tokens", type=int, help="the job's actors.max_tokens")
    p.add_argument("--max-positions", type=int, help="the model's positions (prompt + response)")
    p.add_argument("--group-size", type=int, help="the job's actors.n (samples every group has)")
    p.add_argument("--shard", type=int, default=0, help="which of buffer.ingest_shards this server is")
    p.add_argument("--bind-host", default="auto", help="interface to listen on (cluster.bind_host's values)")
    p.add_argument("overrides", nargs="*", help="buffer.KEY=VALUE")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ingest %(levelname)s %(message)s")
    try:
        buffer = buffer_config(args.overrides)
    except ConfigError as e:
        p.error(str(e))
    proc = IngestProcess(buffer, bind_host=args.bind_host, run_id=args.run_id, redis_url=args.redis_url,
                         vocab_size=args.vocab_size, max_prompt_tokens=args.max_prompt_tokens,
                         max_response_tokens=args.max_response_tokens, max_positions=args.max_positions,
                         shard=args.shard, group_size=args.group_size)
    print(proc.server.address, flush=True)
    proc.run()
    return 0


def buffer_config(overrides: list[str]) -> BufferConfig:
    """The buffer's section from `buffer.KEY=VALUE` overrides (defaults otherwise); another key is an error."""
    data: dict = {}
    for text in overrides:
        key, value = parse_override(text)
        if not key.startswith("buffer."):
            raise ConfigError(key, "the ingest takes only buffer.* keys")
        set_dotted(data, key, value)
    return from_dict(BufferConfig, data.get("buffer"), "buffer")


if __name__ == "__main__":
    raise SystemExit(main())

"""A discrete-event simulator of this system: rollout actors lease prompt groups under the admission
rule of `buffer/store.py` (LEASE_LUA), generate batches whose duration follows their longest
sample (long-tailed lengths), and send them through the ingest (one process, batches queue) to a
FIFO buffer; the learner waits for `groups_per_step` admissible groups (the hard staleness filter
drops the rest and frees their admission slots, as `buffer/sampler.py` does), trains, publishes
version k+1, and actors swap weights between batches. It predicts throughput, idle fractions of
actors and learners (GPU idle time at scale), and the staleness distribution, for `sync`
(generation and training alternate: s = 0, which tests/integration/test_experiments.py shows is
the synchronous schedule) and `async`. Actors are batch actors (the HF engine: one call per leased
batch) or, with `actor_mode=stream`, the streaming vLLM actor: sequences kept in flight and advanced one
token per engine step, groups leased when there is room (a group's samples hold their slots until its last
one ends, as engine.in_flight() counts them) and sent as each ends, weights swapped between engine steps (no
batch barrier). An engine step is a line in the leased sequences in flight (`gen_step_seq_s`), or a monotone
piecewise-linear curve through measured points (`gen_step_curve`): on a GPU shared with the learner a full
engine (512) steps ~7x slower than a lockstep one (~50).

CPU runs share few cores among every process, so the simulator runs processor sharing: with
`cores = C` and a constant background load B, P busy processes each progress at min(1, (C-B)/P);
the learner's latency (waits that are not CPU work) takes no core. On GPUs each process has its
own device: `cores = inf`.

Inputs come from measured runs (`calibrate`): generation cost per batch and per decode step, and
learner cost per sample, from a synchronous run (`experiments.sync` logs them per step); every
other cost from the CPU time each process of an s = 0 run of `cluster.start` spent per step
(`RUN/cpu.jsonl`, written by the launcher: cluster/cpu.py).

Modules: `config` (SimConfig, SimResult), `model` (the rules and the event loop: `simulate`), `runs` (what measured
runs hold), `lengths` (response lengths fitted to them), `calibration` (SimConfig fields from measured runs, and a
run's prediction), `validation` (predicted against measured), `plots`, and `cli` (`python -m experiments.simulate`).
"""

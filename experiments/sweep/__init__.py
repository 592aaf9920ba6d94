"""Off-policy staleness sweep: runs the same job once per (max_staleness, correction, seed), plus the
synchronous baseline (`--sync`, `experiments.sync`) per seed, one after the other (each its own
process tree, run directory and run id, so runs never share CPU or Redis keys), with a live
progress line. Then writes DIR/results.parquet (one row per learner step of every run), PNG plots
and DIR/summary.md. Run directories land in DIR/runs/.

On a lent GPU, where one call lasts minutes: `--run-seconds` stops each run by wall clock after its
first step (runs compare over equal training time), `--budget-s` starts no run that would outlast the
call, and `--resume` keeps the runs that finished before (DIR/runs/*/record.json) and runs the rest;
exit status 3 says runs are left. bench/gpu_staleness.sh drives it on the H200.

Modules: `config` (SweepConfig, the settings and names of runs), `runner` (each run to its end, with a progress
line, and the records of finished ones), `analysis` (pure functions of the records), `report` (parquet, plots,
summary.md) and `cli` (`python -m experiments.staleness`).
"""

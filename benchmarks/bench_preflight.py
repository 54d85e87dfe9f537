"""A large sweep's preflight: every job's config checked before the first starts (`runner.cli.preflight`).

`runner -m seed=range(0,N) train.epochs=1`: the preflight composes the first job's config with Hydra and
checks every group of it; each other job differs in one plain value, set in that config for a moment,
and only the groups it touches are checked again. The reference is the path before it, in the same run:
a Hydra composition and a full check per job (`validate(compose(job))`), timed on the first REFERENCE_JOBS
jobs (at ~0.2 s a job, 2,000 took minutes). Targets: >= 10x the reference's time per job, and the 2,000
jobs' preflight within 60 s (what `runner` shows nothing during but its "checking" line).
Run: `python -m benchmarks.bench_preflight` (or `make bench B=preflight`).
"""

import time

from runner.compose import compose, preflight
from runner.overrides import canonical, variants
from runner.validate import validate

JOBS, REFERENCE_JOBS = 2000, 50
ARGS = ["-m", f"seed=range(0,{JOBS})", "train.epochs=1"]


def main() -> bool:
    preflight(["train.epochs=1"])  # Hydra's and the schemas' first-use costs, outside both timings
    t0 = time.perf_counter()
    preflight(ARGS)
    ours = time.perf_counter() - t0
    jobs = variants(canonical(ARGS[1:]))[:REFERENCE_JOBS]
    t0 = time.perf_counter()
    for job in jobs:
        validate(compose(job))
    reference = (time.perf_counter() - t0) / len(jobs)
    print(f"  {JOBS} jobs: {ours:.1f} s, {1e3 * ours / JOBS:.1f} ms a job; "
          f"composed one by one: {1e3 * reference:.0f} ms a job")  # fmt: skip
    ratio = reference * JOBS / ours
    ok = ratio >= 10
    print(f"  target preflight speed-up over composing each job: measured {ratio:.1f}x, need >= 10x -> "
          f"{'OK' if ok else 'MISS'}")  # fmt: skip
    print(f"  target {JOBS}-job preflight: measured {ours:.1f} s, need <= 60 s -> "
          f"{'OK' if ours <= 60 else 'MISS'}")  # fmt: skip
    return ok and ours <= 60


if __name__ == "__main__":
    main()

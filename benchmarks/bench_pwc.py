"""PWC speed: quasi-greedy vs exact greedy and MILP, and how each method's time grows with N.

2-D standard normal application and development sets, N_app = N_dev = N_cand = N, K = 30 (the
setting of Fig. 2 of the paper). Every method is called with the options of the task's default pwc
config (`+method=pwc`: the entropic selector at the paper's absolute eps `reg` = 0.01 in cost units,
at most 50,000 sweeps). Targets are ratios measured in this run at N = 200.
Run: `python -m benchmarks.bench_pwc` (or `make bench`).
"""

import time

import numpy as np

from runner.compose import compose
from runner.hooks.pwc import cover_options
from runner.methods.pwc import cover

K = 30
TARGET_N = 200
SIZES = (100, 200, 300, 1000, 3000)
# Largest N per method: past these the method takes minutes (greedy ~K N^3, milp and entropic
# grow fastest; sensitivity solves full N x 2N LPs).
MAX_N = {"ctrans": 3000, "sensitivity": 1000, "milp": 300, "entropic": 300, "greedy": 200}
# Repeats (min taken) at N = TARGET_N, where the speed targets are measured.
REPEATS = {"ctrans": 5, "sensitivity": 3, "milp": 2, "entropic": 1, "greedy": 1}


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2)), rng.normal(size=(n, 2))


def _timed(method, n, options, repeats=1):
    X_app, X_dev = _data(n)
    best, result = np.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = cover(X_app, X_dev, K, method, **options)
        best = min(best, time.perf_counter() - start)
    return best, result


def _target(description, measured, bound):
    ok = measured >= bound
    print(f"  target {description}: measured {measured:.1f}x, need >= {bound:g}x -> {'OK' if ok else 'MISS'}")
    return ok


def main() -> bool:
    options = cover_options(compose(["+method=pwc"]).method)  # as runner/tasks/covering.py calls `cover`
    print(f"PWC, 2-D normal data, N_app = N_dev = N_cand = N, K = {K}; options {options}")
    seconds = {}
    print(f"\nN = {TARGET_N}: method, seconds (min of repeats), exact LPs, PW(S_K), phi / phi(MILP)")
    results = {m: _timed(m, TARGET_N, options, REPEATS[m]) for m in REPEATS}
    pw_empty, pw_opt = results["milp"][1].pw[0], results["milp"][1].pw[-1]
    for method, (sec, res) in results.items():
        seconds[method, TARGET_N] = sec
        ratio = (pw_empty - res.pw[-1]) / (pw_empty - pw_opt)
        print(f"  {method:<12} {sec:8.3f} s {res.n_lp:6d} LPs   PW {res.pw[-1]:.6f}   ratio {ratio:.4f}")

    print("\ntime (s) against N; '-' = skipped (minutes)")
    for n in SIZES:
        for method in MAX_N:
            if n <= MAX_N[method] and (method, n) not in seconds:
                seconds[method, n] = _timed(method, n, options)[0]
    print("  N       " + "".join(f"{m:>13}" for m in MAX_N))
    for n in SIZES:
        cells = [f"{seconds[m, n]:13.3f}" if (m, n) in seconds else f"{'-':>13}" for m in MAX_N]
        print(f"  {n:<8}" + "".join(cells))
    growth = []
    for method in MAX_N:
        ns = [n for n in SIZES if (method, n) in seconds]
        slope = np.polyfit(np.log(ns), np.log([seconds[method, n] for n in ns]), 1)[0]
        growth.append(f"{method} ~N^{slope:.1f} (N {ns[0]}-{ns[-1]})")
    print("  growth: " + ", ".join(growth))

    ctrans = seconds["ctrans", TARGET_N]
    ok = _target(f"ctrans vs greedy at N={TARGET_N}, K={K}", seconds["greedy", TARGET_N] / ctrans, 100)
    ok &= _target(f"ctrans vs milp at N={TARGET_N}, K={K}", seconds["milp", TARGET_N] / ctrans, 5)
    return ok


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)

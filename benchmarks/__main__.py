"""`make bench`: run every benchmarks/bench_*.py (or those named on the command line) and tally targets.

Each module's `main() -> bool` prints its table and one `target ...: measured ..., need ... -> OK|MISS`
line per speed target, with ratios measured against a reference in the same run; `None`: nothing to
measure on this machine (a CUDA benchmark without a GPU).
"""

import importlib
import pkgutil
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    names = sorted(
        m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name.startswith("bench_")
    )
    if argv:
        unknown = sorted(set(argv) - set(names) - {n.removeprefix("bench_") for n in names})
        if unknown:
            print(f"unknown benchmark(s) {', '.join(unknown)}; choices: {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in argv or n.removeprefix("bench_") in argv]
    results = {}
    for name in names:
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        results[name] = importlib.import_module(f"benchmarks.{name}").main()
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    print("\n=== summary ===")
    for name, ok in results.items():
        verdict = "skipped, nothing measured" if ok is None else "all targets met" if ok else "TARGET MISSED"
        print(f"{name}: {verdict}")
    return 0 if all(ok is not False for ok in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

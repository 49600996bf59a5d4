"""The chaos suite's long mode: hundreds of iterations of every scenario, and a table.

    python bench/chaos.py --iterations 200            # every scenario, 200 iterations each
    python bench/chaos.py --iterations 50 -k socket   # the scenarios whose name has "socket"
    python bench/chaos.py --seed 1234                 # replay a seed (printed on every run)

Each scenario runs in a process of its own (a hang there cannot spoil the others) and
does not stop at a failure. The scenarios, the watchdog and the leak checks are those of
``tests/chaos`` (``tests/chaos/chaos_harness.py``). Prints: scenario, iterations,
failures, hangs, orphans, leaks, median/max time to error, wall time; exits 1 when any
count is not zero.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHAOS_DIR = ROOT / "tests" / "chaos"


def _one(name: str, iterations: int, seed: int, quiet: bool) -> None:
    sys.path.insert(0, str(CHAOS_DIR))
    import chaos_harness as h

    h.set_env()
    log = (lambda line: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    stats = h.run_scenario(name, iterations, seed, log=log, stop_on_failure=False)
    for f in stats.failures:
        print(f, file=sys.stderr, flush=True)
    print("CHAOS-RESULT " + json.dumps(stats.row()), flush=True)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=200, help="iterations of each scenario")
    ap.add_argument("--seed", type=int, default=None, help="the seed (default: random)")
    ap.add_argument("-k", dest="select", default="", help="only scenarios whose name has this")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per iteration")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    if args.one:
        _one(args.one, args.iterations, seed, not args.verbose)
        return 0

    sys.path.insert(0, str(CHAOS_DIR))
    from chaos_harness import SCENARIOS

    names = [n for n in SCENARIOS if args.select in n]
    print(
        f"chaos: seed {seed}, {args.iterations} iterations of {len(names)} scenario(s)", flush=True
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), *sys.path] if p)
    rows = []
    for name in names:
        deadline = SCENARIOS[name][1]
        cmd = [
            sys.executable,
            __file__,
            "--one",
            name,
            "--iterations",
            str(args.iterations),
            "--seed",
            str(seed),
        ]
        if args.verbose:
            cmd.append("-v")
        t0 = time.monotonic()
        try:
            out = subprocess.run(
                cmd, env=env, stdout=subprocess.PIPE, text=True,
                timeout=120 + args.iterations * (deadline + 15),
            ).stdout  # fmt: skip
        except subprocess.TimeoutExpired:
            out = ""
        row = None
        for line in out.splitlines():
            if line.startswith("CHAOS-RESULT "):
                row = json.loads(line[len("CHAOS-RESULT ") :])
        if row is None:  # the runner itself died or hung
            row = {"scenario": name, "iterations": 0, "failures": 1, "hangs": 1, "orphans": 0,
                   "leaks": 0, "median_s": None, "max_s": None, "wall_s": time.monotonic() - t0}  # fmt: skip
        rows.append(row)
        print(
            f"  {name}: {row['iterations']} it, {row['failures']} failures, {row['hangs']} hangs, "
            f"{row['orphans']} orphans, {row['leaks']} leaks ({row['wall_s']:.0f} s)",
            flush=True,
        )
    head = ("scenario", "iters", "fail", "hangs", "orphans", "leaks", "median s", "max s", "wall s")
    print()
    print(f"{head[0]:<20} " + " ".join(f"{h:>8}" for h in head[1:]))
    for r in rows:
        cells = [r["iterations"], r["failures"], r["hangs"], r["orphans"], r["leaks"]]
        print(
            f"{r['scenario']:<20} " + " ".join(f"{c:>8}" for c in cells)
            + f" {_fmt(r['median_s']):>8} {_fmt(r['max_s']):>8} {r['wall_s']:>8.0f}"
        )  # fmt: skip
    print(
        f"seed {seed}: replay with python bench/chaos.py --seed {seed} --iterations {args.iterations}"
    )
    if args.json:
        args.json.write_text(json.dumps({"seed": seed, "rows": rows}, indent=1))
    bad = any(r["failures"] or r["hangs"] or r["orphans"] or r["leaks"] for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

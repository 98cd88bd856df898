#!/usr/bin/env python3
"""The load stall per placement: a `loip local` run's own (its workers' hop traces) beside the
cost model's (`loip simulate --from-local`'s `placement steps A-B` lines).

    stall_per_placement.py RUN.err SIMULATE.out

RUN.err: the run's stderr with LOIP_HOP_TRACE=1 (the coordinator's `mark=warm-up` and
`mark=warmed` lines split the warm-up's steps from the run's; the run's first step after
them is its prompt, step 0). Prints the warm-up's stall (the median over its steps, and
the page cache's dirty and writeback kB at its start) and, per placement, the run's mean
stall per decode step (the workers' stalls of a step added up) against the priced one.
Used by bench/runtime_vs_sim.sh with TRACE=1. Prints numbers; asserts nothing.
"""
import re
import statistics
import sys


def main(err_path, sim_path):
    phase, steps, marks = "pre", {}, []
    with open(err_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if "loip-hop-trace " not in line:
                continue
            kv = dict(x.split("=", 1) for x in line.split()[1:] if "=" in x)
            if "mark" in kv:
                marks.append(kv)
                phase = {"warm-up": "warm", "warmed": "run"}.get(kv["mark"], phase)
                continue
            s = steps.setdefault(int(kv["step"]), [phase, 0.0, 0.0, 0, 0.0])
            s[1] += float(kv.get("stall", 0)) / 1e3  # ms
            s[2] += float(kv.get("load", 0)) / 1e3  # ms
            s[3] += int(kv.get("loaded", 0))
            s[4] += float(kv.get("compute", 0)) / 1e3  # ms
    warm = [v[1] for v in steps.values() if v[0] == "warm"]
    run = sorted(k for k, v in steps.items() if v[0] == "run")
    if not run:
        print("stall per placement: no traced run steps (LOIP_HOP_TRACE=1 for the run)")
        return
    at = {k - run[0]: steps[k] for k in run}  # run step -> trace
    m = next((x for x in marks if x.get("mark") == "warm-up"), {})
    if warm:
        print(
            "warm-up: stall %.2f ms a step (median of %d), dirty %s kB, writeback %s kB at its start"
            % (statistics.median(warm), len(warm), m.get("dirty_kb", "?"), m.get("writeback_kb", "?"))
        )
    drift([steps[k] for k in sorted(steps) if steps[k][0] == "warm"], [at[k] for k in sorted(at) if k > 0])
    pat = re.compile(r"placement steps (\d+)-(\d+): priced ([0-9.]+) ms/token, stall ([0-9.]+) ms")
    with open(sim_path, encoding="utf-8") as f:
        for line in f:
            g = pat.search(line)
            if not g:
                continue
            a, b = int(g.group(1)), int(g.group(2))
            got = [at[k] for k in range(a, b + 1) if k in at]
            if not got:
                continue
            stall = statistics.mean(x[1] for x in got)
            load_ms = sum(x[2] for x in got)
            rate = sum(x[3] for x in got) / load_ms / 1e6 if load_ms > 0 else 0.0  # GB/s
            print(
                "placement steps %d-%d: stall %.2f measured / %.2f priced ms (loaders %.2f GB/s each while reading)"
                % (a, b, stall, float(g.group(4)), rate)
            )


# decode steps a window of the drift line covers: the re-priced prediction's K
WINDOW = 8


def drift(warm, run):
    """The VM's drift between the warm-up and the run: the compute of a step (the workers'
    blocks and head added up) and the loaders' rate while reading (bytes over reading time,
    all workers), the warm-up's (over its steps) against the run's, window by window of
    WINDOW decode steps, and the run's first window against the rest (what the re-priced
    prediction extrapolates)."""

    def rate(xs):
        ms = sum(x[2] for x in xs)
        return sum(x[3] for x in xs) / ms / 1e6 if ms > 0 else 0.0  # GB/s

    if not warm or len(run) <= WINDOW:
        return
    wins = [run[i : i + WINDOW] for i in range(0, len(run), WINDOW)]
    c0 = statistics.median(x[4] for x in warm)
    cw = [statistics.mean(x[4] for x in w) for w in wins]
    first, rest = run[:WINDOW], run[WINDOW:]
    print(
        "drift: compute a step warm-up %.2f ms (median), run %.2f (mean); windows of %d: %s; first %d %.2f, rest %.2f"
        % (c0, statistics.mean(x[4] for x in run), WINDOW, " ".join("%.2f" % c for c in cw), WINDOW,
           statistics.mean(x[4] for x in first), statistics.mean(x[4] for x in rest))
    )
    if rate(run) > 0:
        print(
            "drift: loaders GB/s while reading warm-up %.2f, run %.2f; windows: %s; first %d %.2f, rest %.2f"
            % (rate(warm), rate(run), " ".join("%.2f" % rate(w) for w in wins), WINDOW, rate(first), rate(rest))
        )


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

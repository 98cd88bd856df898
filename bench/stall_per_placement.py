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
            s = steps.setdefault(int(kv["step"]), [phase, 0.0, 0.0, 0])
            s[1] += float(kv.get("stall", 0)) / 1e3  # ms
            s[2] += float(kv.get("load", 0)) / 1e3  # ms
            s[3] += int(kv.get("loaded", 0))
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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])

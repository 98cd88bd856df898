#!/usr/bin/env bash
# The memory contract measured: SmolLM2 on `loip local` worker processes, each run once in a
# memory cgroup of exactly its --mem (`--cgroup`) and once without, interleaved over ROUNDS;
# prints one table row per scenario: budgets, the engine's share, the highest peak charge the
# kernel recorded (memory.peak / max_usage_in_bytes), OOM kills, and ms/token with and
# without the cgroup (medians), every worker planned with the same fixed device profile.
# Needs root (or a delegated cgroup) and a release build.
#
# usage: bench/budget_cgroup.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
loip=target/release/loip
[ -x "$loip" ] || { echo "build first: cargo build --release -p loip-cli" >&2; exit 1; }
prompt="Tell me a story about a lighthouse keeper and a storm"
# one fixed device profile for every worker, so both runs of a pair follow the same plan (a
# measured profile follows the machine's load, and the plan with it)
profile=crates/loip-cli/tests/fixtures/smollm2-device-profile.json
scenarios=(
  "3 workers, 66 MiB each|--devices 3 --mem 66MiB -n 64 --min-tokens 64"
  "3 workers, default budgets|--devices 3 -n 64 --min-tokens 64"
  "3 workers, 61/33/61 MiB + 28 MiB process, 1,500 tokens|--devices 3 --mem 89MiB,61MiB,89MiB -n 1500 --min-tokens 1500"
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| scenario | budgets | engine share (devices in the plan) | peak charge (highest worker) | OOM kills | ms/token in cgroups | ms/token without |"
echo "|---|---|---|---|---|---|---|"
for s in "${scenarios[@]}"; do
  name=${s%%|*}
  args=${s#*|}
  for r in $(seq "$rounds"); do
    # shellcheck disable=SC2086
    "$loip" local --json --profile "$profile" --prompt "$prompt" $args --cgroup >"$tmp/cg.$r.json" 2>/dev/null || echo '{}' >"$tmp/cg.$r.json"
    # shellcheck disable=SC2086
    "$loip" local --json --profile "$profile" --prompt "$prompt" $args >"$tmp/plain.$r.json" 2>/dev/null || echo '{}' >"$tmp/plain.$r.json"
  done
  python3 - "$tmp" "$rounds" "$name" <<'EOF'
import json, statistics, sys
tmp, rounds, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(kind):
    out = []
    for r in range(1, rounds + 1):
        text = open(f"{tmp}/{kind}.{r}.json").read().strip().splitlines()
        line = next((l for l in reversed(text) if l.startswith("{")), "{}")
        out.append(json.loads(line))
    return out
cg, plain = load("cg"), load("plain")
mib = lambda b: f"{b / 2**20:.1f} MiB"
ok = [v for v in cg if v.get("cgroups")]
if not ok:
    print(f"| {name} | – | – | – | failed | – | – |")
    sys.exit()
limits = [c["limit"] for c in ok[0]["cgroups"]]
engine = [d.get("budget_bytes", 0) for d in ok[0].get("plan", {}).get("devices", [])]
peak = max(c["peak"] for v in ok for c in v["cgroups"])
kills = sum(c["oom_kills"] for v in ok for c in v["cgroups"]) + (rounds - len(ok))
ms = lambda vs: statistics.median(v["ms_per_token"] for v in vs if "ms_per_token" in v) if any("ms_per_token" in v for v in vs) else float("nan")
print(f"| {name} | {', '.join(mib(l) for l in limits)} | {', '.join(mib(e) for e in engine)} | "
      f"{mib(peak)} ({100 * peak / max(limits):.0f} %) | {kills} | {ms(cg):.2f} | {ms(plain):.2f} |")
EOF
done

#!/usr/bin/env bash
# The runtime against the simulator on this machine: runs `loip local --json` (real worker
# processes on loopback), replays the same plan, measured profiles and request in the
# simulator (`loip simulate --from-local`), and prints the threshold switches and ms/token of
# both. Prints numbers; asserts nothing.
#
#   bench/runtime_vs_sim.sh [ROUNDS] [-- extra `loip local` arguments]
#
# Default run: SmolLM2 on one worker of 64 MiB, 450 tokens (a threshold is crossed at ~389).
set -euo pipefail
LOIP=${LOIP:-target/release/loip}
ROUNDS=${1:-1}
shift || true
[ "${1:-}" = "--" ] && shift
if [ $# -eq 0 ]; then
  set -- --model smollm2 --devices 1 --mem 64MiB \
    --prompt "Tell me a very long story about a dragon" --max-tokens 450 --min-tokens 450
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r: loip local $*"
  "$LOIP" local --json "$@" > "$tmp/run.json" 2> "$tmp/err.txt" || { cat "$tmp/err.txt"; exit 1; }
  "$LOIP" simulate --from-local "$tmp/run.json"
done

#!/usr/bin/env bash
# The runtime against the cost model and the simulator on this machine: runs `loip local --json`
# (real worker processes on loopback) ROUNDS times, and for each run prints the cost model's
# prediction (each decode step priced with the placement its threshold switches left in force)
# against the measured ms/token term by term (compute; a token's hops: network,
# queueing and the workers' time outside blocks; load stall; the coordinator's part; the steps
# parked for threshold switches) and the re-priced prediction (the cost model fed the rates the
# run's first 8 decode steps measured, over the remaining steps, against those steps), then a
# table of all runs; with --sim also the simulator's
# replay of each run (`loip simulate --from-local`: ms/token and threshold switches). Prints
# numbers; asserts nothing.
#
#   bench/runtime_vs_sim.sh [ROUNDS] [--sim] [-- `loip local` arguments]
#
# Default run: the cost model's 3-worker check, SmolLM2 on three workers, 64 tokens, `loip
# local`'s default budgets (every plan streams), the workers' loads priced as sharing one disk:
#   bench/runtime_vs_sim.sh 8
# A threshold replay (one worker of 64 MiB, 450 tokens: its switches priced by the simulator):
#   bench/runtime_vs_sim.sh 1 --sim -- --model smollm2 --devices 1 --mem 64MiB \
#     --prompt "Tell me a very long story about a dragon" --max-tokens 450 --min-tokens 450
# KEEP=DIR keeps each run's JSON as DIR/run-N.json, to price again with `loip simulate
# --from-local DIR/run-N.json` after a change to the cost model, and its stderr as
# DIR/run-N.err (with LOIP_LOG=info: the warm-up's figures).
# REPRICE_WEIGHTS=C,L prices the re-priced column with other weights on the factors of compute
# and loads the run's first decode steps measured (`loip simulate --reprice-weights`).
# TRACE=1 runs the workers with LOIP_HOP_TRACE=1 and prints, per placement the run held
# (between its threshold switches), its load stall per decode step beside the cost model's
# (bench/stall_per_placement.py; the traces slow the run a little).
set -euo pipefail
LOIP=${LOIP:-target/release/loip}
ROUNDS=${1:-1}
shift || true
SIM=0
if [ "${1:-}" = "--sim" ]; then
  SIM=1
  shift
fi
[ "${1:-}" = "--" ] && shift
if [ $# -eq 0 ]; then
  # the three workers read this machine's one disk: priced as sharing it (`--shared-disk`)
  set -- -m smollm2 --devices 3 -n 64 --ignore-eos --shared-disk
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rows=()
for r in $(seq 1 "$ROUNDS"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  echo "== round $r (load $load): loip local $*"
  if [ "${TRACE:-0}" = 1 ]; then
    LOIP_HOP_TRACE=1 "$LOIP" local --json "$@" > "$tmp/run.json" 2> "$tmp/err.txt" || { tail -20 "$tmp/err.txt"; exit 1; }
  else
    "$LOIP" local --json "$@" > "$tmp/run.json" 2> "$tmp/err.txt" || { cat "$tmp/err.txt"; exit 1; }
  fi
  if [ -n "${KEEP:-}" ]; then
    mkdir -p "$KEEP"
    cp "$tmp/run.json" "$KEEP/run-$r.json"
    cp "$tmp/err.txt" "$KEEP/run-$r.err"
  fi
  out=$("$LOIP" simulate --from-local "$tmp/run.json" ${REPRICE_WEIGHTS:+--reprice-weights "$REPRICE_WEIGHTS"})
  if [ "$SIM" = 1 ]; then
    echo "$out"
  else
    echo "$out" | sed -n '2,4p'
    echo "$out" | grep '^re-priced' || true
    echo "$out" | grep -A2 '^| measured'
    echo "$out" | grep '^placement steps' || true
  fi
  if [ "${TRACE:-0}" = 1 ]; then
    echo "$out" > "$tmp/sim.txt"
    python3 "$(dirname "$0")/stall_per_placement.py" "$tmp/err.txt" "$tmp/sim.txt"
  fi
  row=$(echo "$out" | grep -m1 '^| [0-9]')
  rows+=("| $r | $load ${row}")
done
echo
echo "| run | load | measured ms/token | predicted ÷ measured | compute meas./pred. | hops meas./pred. | (of which in-worker) | load stall meas./pred. | coordinator meas./pred. | switch parks meas./pred. | loaded MB/token | plan as started ÷ measured | re-priced ÷ measured, after 8 steps |"
echo "|---:|---:|---:|---:|---|---|---:|---|---|---|---:|---:|---:|"
printf '%s\n' "${rows[@]}"

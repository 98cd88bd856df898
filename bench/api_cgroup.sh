#!/usr/bin/env bash
# The API at its cgroup's limit: `loip api -m smollm2 --mem 320MiB --parallel 8 --context 512`
# in a memory cgroup of exactly 320 MiB (v1 or v2, a child of this shell's own), the page cache
# dropped first; bursts of 8 (`loip bench serve --requests 16 --concurrency 8 --prompt-len 30
# --output-len 24`), conversations (`--requests 16 --turns 4 --concurrency 4`), then 8 concurrent
# 250-word prompts (`--requests 8 --concurrency 8 --prompt-len 250 --output-len 16`). Samples the cgroup every 0.2 s while it
# runs (charge, anonymous memory, page cache, mapped files, inactive file pages, dirty and
# writeback, pressure events) and prints the peak, the pressure events (v1 failcnt, v2
# memory.events max + high), OOM kills, what the server shed (`/health` memory.shed) and the
# samples around the peak. Needs root and a release build.
#
# usage: bench/api_cgroup.sh [LOIP_BINARY] [PORT]   (KEEP=DIR: copy the memory.stat of the
# sample with the highest charge there)
set -euo pipefail
cd "$(dirname "$0")/.."
loip=${1:-target/release/loip}
port=${2:-18093}
[ -x "$loip" ] || { echo "build first: cargo build --release -p loip-cli" >&2; exit 1; }
limit=$((320 << 20))
own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup)
if [ -n "$own" ] && [ -d "/sys/fs/cgroup/memory$own" ]; then
  v=1 cg="/sys/fs/cgroup/memory$own/loip-api-check-$$"
  mkdir "$cg"; echo "$limit" >"$cg/memory.limit_in_bytes"
  echo "$limit" >"$cg/memory.memsw.limit_in_bytes" 2>/dev/null || true
  echo 0 >"$cg/memory.swappiness" 2>/dev/null || true
else
  mnt=$(awk '$9 == "cgroup2" {print $5; exit}' /proc/self/mountinfo)
  own=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  v=2 cg="$mnt$own/loip-api-check-$$"
  mkdir "$cg"; echo "$limit" >"$cg/memory.max"; echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
fi
tmp=$(mktemp -d)
api=
cleanup() {
  [ -n "$api" ] && kill "$api" 2>/dev/null && wait "$api" 2>/dev/null
  rmdir "$cg" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
stat1() { awk -v k="$1" '$1 == k {print $2}' "$cg/memory.stat"; }
mkdir "$tmp/stat"
sample() {
  t=$(date +%s.%N | cut -c1-14)
  cp "$cg/memory.stat" "$tmp/stat/$t"
  if [ $v = 1 ]; then
    echo "$t $(cat "$cg/memory.usage_in_bytes") $(stat1 total_rss) $(stat1 total_cache) \
$(stat1 total_mapped_file) $(stat1 total_inactive_file) $(stat1 total_active_file) $(stat1 total_dirty) \
$(stat1 total_writeback) $(cat "$cg/memory.failcnt")"
  else
    ev=$(awk '$1 == "max" || $1 == "high" {s += $2} END {print s + 0}' "$cg/memory.events")
    echo "$t $(cat "$cg/memory.current") $(stat1 anon) $(stat1 file) \
$(stat1 file_mapped) $(stat1 inactive_file) $(stat1 active_file) $(stat1 file_dirty) \
$(stat1 file_writeback) $ev"
  fi
}
sync; echo 3 >/proc/sys/vm/drop_caches
bash -c "echo \$\$ > $cg/cgroup.procs; exec $loip api -m smollm2 --mem 320MiB --parallel 8 --context 512 --listen 127.0.0.1:$port" \
  >"$tmp/api.out" 2>"$tmp/api.err" &
api=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$api" 2>/dev/null || { cat "$tmp/api.err" >&2; exit 1; }
  sleep 0.2
done
grep -E "^Rss" "/proc/$api/status" | tr -s ' \t' ' ' | tr '\n' ' ' | sed 's/^/api at start: /'; echo
(for _ in $(seq 3000); do sample; sleep 0.2; done) >"$tmp/samples" &
sampler=$!
# the engine's KV as the scheduler counts it beside the process's anonymous memory
(for _ in $(seq 3000); do
  kv=$(curl -s -m 1 "http://127.0.0.1:$port/health" | python3 -c 'import json,sys; s=json.load(sys.stdin)["scheduler"]; print(s["kv_used_bytes"], s["kv_reserved_bytes"], s["running"])' 2>/dev/null || echo "- - -")
  echo "$(date +%s.%N | cut -c1-14) $(awk '/RssAnon/ {print $2 * 1024}' "/proc/$api/status") $kv"
  sleep 0.2
done) >"$tmp/kv" &
kvs=$!
sampler=$!
for phase in "--requests 16 --concurrency 8 --prompt-len 30 --output-len 24" \
  "--requests 16 --turns 4 --concurrency 4" \
  "--requests 8 --concurrency 8 --prompt-len 250 --output-len 16"; do
  # shellcheck disable=SC2086
  "$loip" bench serve --url "http://127.0.0.1:$port" $phase >>"$tmp/bench.out" 2>&1 ||
    echo "bench serve $phase failed: $(tail -3 "$tmp/bench.out")"
done
sleep 0.5
kill "$sampler" "$kvs" 2>/dev/null; wait "$sampler" "$kvs" 2>/dev/null || true
[ -n "${KEEP:-}" ] && cp "$tmp/kv" "$KEEP/kv.$$"
grep -E "^(Rss|VmHWM)" "/proc/$api/status" | tr -s ' \t' ' ' | tr '\n' ' ' | sed 's/^/api at the end: /'; echo
health=$(curl -sf "http://127.0.0.1:$port/health" || echo '{}')
if [ $v = 1 ]; then
  peak=$(cat "$cg/memory.max_usage_in_bytes"); events=$(cat "$cg/memory.failcnt")
  kills=$(awk '$1 == "oom_kill" {print $2}' "$cg/memory.oom_control")
else
  peak=$(cat "$cg/memory.peak" 2>/dev/null || echo 0)
  events=$(awk '$1 == "max" || $1 == "high" {s += $2} END {print s + 0}' "$cg/memory.events")
  kills=$(awk '$1 == "oom_kill" {print $2}' "$cg/memory.events")
fi
grep -E "budget|memory pressure|context|KV" "$tmp/api.err" | sed 's/^/api: /' | head -20
grep -E "requests \(" "$tmp/bench.out" | sed 's/^/bench: /'
python3 - "$tmp/samples" "$peak" "$events" "${kills:-0}" "$v" "$health" "$tmp/stat" "${KEEP:-}" <<'PY'
import json, shutil, sys
path, peak, events, kills, v, health, stats, keep = sys.argv[1:]
mib = lambda b: f"{int(b) / 2**20:.1f}"
rows = [l.split() for l in open(path) if len(l.split()) == 10]
print(f"cgroup v{v} of 320 MiB: peak {mib(peak)} MiB, pressure events {events}, OOM kills {kills}")
shed = json.loads(health).get("memory", {}).get("shed", {})
print(f"shed: {shed}")
if rows:
    top = max(range(len(rows)), key=lambda i: int(rows[i][1]))
    print("MiB at the first sample, the highest and around it: charge anon cache mapped inactive_file active_file dirty writeback events")
    for r in [rows[0]] + rows[max(0, top - 3): top + 3]:
        print(" ".join([r[0]] + [mib(x) for x in r[1:9]] + [r[9]]))
    if keep:
        shutil.copy(f"{stats}/{rows[top][0]}", f"{keep}/memory.stat.v{v}.{rows[top][1]}")
    print(f"samples: {len(rows)}; highest anon {mib(max(int(r[2]) for r in rows))} MiB, highest cache {mib(max(int(r[3]) for r in rows))} MiB")
PY

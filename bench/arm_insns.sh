#!/usr/bin/env bash
# Instructions executed by one 64x1536 matmul on aarch64 (under qemu-user), portable path
# against NEON, per 32 weights and token (docs/benchmarks.md, "ARM (NEON)"). DTYPES (default
# "Q4_1 Q4_0 Q8_0 F16 BF16 F32") picks the stored types. Needs the aarch64 target,
# gcc-aarch64-linux-gnu and qemu-user (as .ci/run). Counts, not times: an emulator says
# nothing about a real core's speed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
nice cargo build --release --target aarch64-unknown-linux-gnu -p loip-kernels --example one_matmul
bin=target/aarch64-unknown-linux-gnu/release/examples/one_matmul
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# guest instructions executed: every translated block's length times its executions
count() {
  RAYON_NUM_THREADS=1 qemu-aarch64 -L /usr/aarch64-linux-gnu -d in_asm,exec,nochain -D "$log" \
    "$bin" "$@" >/dev/null
  awk '
    /^IN:/ { cur = ""; next }
    /^0x[0-9a-f]+: +[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f] / { a = substr($1, 3, length($1) - 3); if (cur == "") cur = a; len[cur]++; next }
    /^Trace/ { split($0, f, "/"); pc = f[2]; sub(/^0+/, "", pc); runs[pc]++; next }
    /^$/ { cur = "" }
    END { for (p in runs) s += runs[p] * len[p]; printf "%d\n", s }
  ' "$log"
}
blocks=$((64 * 1536 / 32))
printf '%-5s %3s %10s %10s\n' dtype n portable neon
# one matmul: two runs minus one (the setup and the thread pool's start cancel)
one() { echo $(( $(count "$@" 2) - $(count "$@" 1) )); }
for dtype in ${DTYPES:-Q4_1 Q4_0 Q8_0 F16 BF16 F32}; do
  for n in 1 8; do
    s=$(one "$dtype" "$n" scalar)
    v=$(one "$dtype" "$n" simd)
    awk -v d="$dtype" -v n="$n" -v s="$s" -v v="$v" -v k="$blocks" \
      'BEGIN { printf "%-5s %3d %10.1f %10.1f\n", d, n, s / (k * n), v / (k * n) }'
  done
done

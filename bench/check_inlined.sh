#!/usr/bin/env bash
# Fails if a kernel of loip-kernels calls a SIMD intrinsic out of line in a release binary.
#
# A closure (for example one passed to `std::array::from_fn` or `[T; N]::map`) is a function
# of its own without the `#[target_feature]` of the kernel around it: when LLVM does not
# inline it, every intrinsic inside becomes a call (`core::core_arch::...`) with a
# `vzeroupper` before it, and the kernel runs several times slower with the same results.
# That happened to the AVX-512 Q3_K kernel (2.2 against 3.9 GB/s) and to experimental builds
# of the short tiles (2-3.6x slower), silently. Release binaries only (debug builds inline
# nothing).
#
# usage: bench/check_inlined.sh [BINARY]   (default target/release/loip)
set -euo pipefail
bin=${1:-target/release/loip}
command -v objdump >/dev/null || { echo "check_inlined: objdump not found; skipped"; exit 0; }
[ -x "$bin" ] || { echo "check_inlined: $bin not built; skipped"; exit 0; }
bad=$(objdump -d --no-show-raw-insn -C "$bin" | awk '
    /^[0-9a-f]+ <.*>:$/ { name = $0 }
    /call.*(<core::core_arch::|call_mut>)/ && name ~ /loip_kernels::/ { print name }' | sort | uniq -c)
if [ -n "$bad" ]; then
    echo "check_inlined: kernels calling intrinsics or closures out of line in $bin:"
    echo "$bad"
    exit 1
fi
echo "check_inlined: no out-of-line intrinsic calls in loip-kernels ($bin)"

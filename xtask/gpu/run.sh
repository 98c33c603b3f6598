#!/usr/bin/env bash
# Ferry's GPU check, from `cargo xtask gpu-bundle`: runs the prebuilt
# `cuda`-feature tests and the CUDA channels' benchmark on a machine with
# a GPU and no Rust toolchain (no cargo, no network). Logs go to $OUT (the
# device tool's folder) or to out/ beside this script.
#
#   bash target/gpu-bundle/run.sh
#
# Exit status: 0 when every step passed on a GPU; 1 when a step failed
# (or ran out of its time); 2 when the GPU group skipped (no usable CUDA
# device here), which on a GPU machine is a failure of the check, not a
# pass. The steps' time limits add up to 9 minutes, inside the device
# tool's 10 minutes a command.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"

# The driver's library (cudarc loads libcuda.so.1 at run time): where the
# loader finds it, else in the usual driver folders.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
  for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
    if [ -e "$d/libcuda.so.1" ]; then
      export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      break
    fi
  done
fi
{ nvidia-smi -L || echo "nvidia-smi: not found or failed"; } 2>&1 | tee "$out/gpus.txt"

failed=()
# step NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS, its
# output to the terminal and to $out/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  echo "==> $name: $*"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "<== $name: exit $rc"
  [ "$rc" = 0 ] || failed+=("$name")
}

# Unit tests of the CUDA modules (staged pipeline, IPC records, device maps).
step unit 60 "$here/bin/unit" cuda:: device_map:: --test-threads=2
# The CPU-side CUDA tests (they return early where CUDA is present).
step cuda_cpu 60 "$here/bin/cuda_cpu" --test-threads=2
# The GPU group; --nocapture shows its SKIPPED line, if any.
step cuda 240 "$here/bin/cuda" --test-threads=1 --nocapture
# Each CUDA channel's bandwidth against a local device-to-device copy.
step bench 180 "$here/bin/cuda_bench"

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (logs in $out)"
  exit 1
fi
if grep -h "SKIPPED: no CUDA device" "$out/cuda.log" "$out/bench.log"; then
  echo "SKIPPED: the GPU group did not run (above); on a GPU machine that is a failure"
  exit 2
fi
echo "PASSED: every step ran on the GPU (logs in $out)"

#!/bin/bash
# Prepared in the ninth session, run in the tenth (output in h200-2026-11-30-ab-10th-session.log,
# which led to the walks' inner rounds, ab42.py): ncu on the two
# kernels that limit issues 4 and 5 now, each backend's against the other's.
#  * the 3x3 walk on big-f16 (cupy 109 us, numba_cuda 124 us, for 237 MB of T and S):
#    what bounds it (DRAM bytes and throughput, L1/L2 hit rates, warp stalls)?
#  * the update on mid (numba_cuda 59 us, cupy 55, a plain probe 54 on the same rows):
#    where do numba_cuda's 4 us go (instructions, stalls, bytes)?
# Run from the repository root on an nvidia-h200 machine, carry .whl:
#   bash docs/results/scripts/ncu_next.sh
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=docs/results/scripts/one_call.py
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,l1tex__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread
for run in "big-f16 cupy walk" "big-f16 numba_cuda walk" "mid cupy stream" "mid numba_cuda stream"; do
  set -- $run
  # the second call's kernel: skip the first call's three launches
  timeout 120 ncu --clock-control none -k regex:$3 --launch-skip 1 --launch-count 1 \
      --metrics $M --section WarpStateStats python3 $S $1 $2 > "$OUT/ncu-$1-$2.txt" 2>&1
  echo "== $1 $2 $3"; grep -E "walk|stream|duration|bytes|throughput|hit_rate|warps_active|inst_exec|registers|Stall|stall" "$OUT/ncu-$1-$2.txt" | sed -E 's/ +/ /g' | cut -c1-120
done

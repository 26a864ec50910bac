#!/bin/bash
# Fourteenth session (output: ../h200-2026-11-30-ncu-14th-session.log): DRAM bytes and rate,
# as a share of the H200's peak, of each kernel on mid (cupy and numba_cuda) and big-f16
# (cupy): which kernels run at their access pattern's limit? The copy step profiles nothing
# (torch's device copy is a cudaMemcpy). Run from the repository root, carry .whl:
#   bash docs/results/scripts/ncu14.sh
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=docs/results/scripts/one_call.py
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum.per_second,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size
for run in "mid cupy gsum" "mid cupy sbox" "mid cupy stream" "mid numba_cuda gsum" "mid numba_cuda stream" "big-f16 cupy gsum" "big-f16 cupy sbox" "big-f16 cupy stream"; do
  set -- $run
  timeout 100 ncu --clock-control none -k regex:$3 --launch-skip 1 --launch-count 1 \
      --metrics $M python3 $S $1 $2 > "$OUT/ncu.txt" 2>&1
  echo "== $1 $2 $3"; grep -E "^  [a-z_]|duration|bytes|throughput|hit_rate|warps_active|registers|grid_size|block_size" "$OUT/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-120
done
timeout 100 ncu --clock-control none --launch-skip 1 --launch-count 1 --metrics $M python3 docs/results/scripts/copy_call.py > "$OUT/ncu.txt" 2>&1
echo "== copy 2 GiB"; grep -E "^  [a-zA-Z_]|duration|bytes|throughput|hit_rate" "$OUT/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-120

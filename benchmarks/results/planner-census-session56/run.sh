#!/usr/bin/env bash
# Session 56: what the no-offload peak holds that the planner (mcore_offload/plan) does not count. One GPU, after
# `source .gpu/w/setup.sh 0.15.3` (no patch needed: nothing is offloaded). Each run: 3 steps, the peak of step 1
# replayed (--peak-trace) and what is allocated at its start after zero_grad (--peak-trace-census).
#   bash benchmarks/results/planner-census-session56/run.sh OUTDIR
set -u
out=${1:?outdir}; mkdir -p "$out"
PP1="--seq-length 4096 --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --num-microbatches 4"
MOE="--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --num-experts 16
     --moe-router-topk 4 --moe-ffn-hidden-size 1024"  # config C's model (benchmarks/peak_memory.py)
DENSE="--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192"  # config A's
RUN="--train-iters 3 --warmup-steps 1 --peak-trace-census"
port=29610
run() {
  local name=$1; shift
  port=$((port + 1))
  local t0=$SECONDS
  timeout 200 torchrun --nproc-per-node 1 --master-port $port benchmarks/pretrain_gpt.py "$@" $RUN \
    --json-out "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$out/runs.txt"
}
# C as measured in benchmarks/results/issue4-h100-pp1 (deterministic, alltoall: pretrain_gpt.py's default on a GPU)
run C-det $MOE $PP1 --deterministic
# the same without deterministic algorithms: megatron-core's unpermute takes scatter_add_ instead of index_add_
run C-nondet $MOE $PP1
# megatron-core's default dispatcher
run C-allgather-det $MOE $PP1 --deterministic --moe-token-dispatcher-type allgather
# A: the dense model's gap
run A-det $DENSE $PP1 --deterministic
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
M = 2**20
for js in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(js.read_text())["ranks"][0]
    pt = r.get("peak_trace") or {}
    c = pt.get("census") or {}
    print(f"{js.stem}: peak step1 {r['peak_bytes_step1'] / M:.1f} MiB, replayed {pt.get('peak_bytes', 0) / M:.1f}, "
          f"census at start {c.get('allocated_bytes', 0) / M:.1f} MiB, wrapped {pt.get('history_wrapped')}")
PY

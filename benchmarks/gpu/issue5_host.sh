#!/usr/bin/env bash
# Where the host time of a launch-bound step goes (issue 5). GPU host, project root, 0.15.3 patched:
#   bash benchmarks/gpu/issue5_host.sh OUTDIR
# 1. per-call host cost of each CUDA / autograd primitive on the hot path (benchmarks/gpu/host_costs.py);
# 2. config A cut to 4 layers, 30 steps each, interleaved: baseline; ours core_attn; ours core_attn with
#    min_offloaded_tensor_size above every tensor (points, groups and hooks run, nothing moves), twice.
set -u
out=${1:?outdir}; mkdir -p "$out"
python3 benchmarks/gpu/host_costs.py --out "$out/host_costs.json" 2>&1 | tail -30
A="--num-layers 4 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096
   --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --deterministic --num-microbatches 4
   --train-iters ${ITERS:-30} --warmup-steps 5"
OFF="--fine-grained-activation-offloading --offload-modules core_attn"
i=0
for rep in 1 2; do
  for v in "baseline|" "core_attn|$OFF" "hooks_only|$OFF --min-offloaded-tensor-size 1000000000000"; do
    name=${v%%|*}; flags=${v#*|}; i=$((i + 1))
    timeout 150 torchrun --nproc-per-node 1 --master-port $((29520 + i)) benchmarks/pretrain_gpt.py $A $flags \
      --json-out "$out/$name-$rep.json" --label "$name" > "$out/$name-$rep.log" 2>&1 || echo "FAILED $name-$rep"
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics as st, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*-[12].json")):
    r = json.loads(f.read_text())["ranks"][0]
    t = r["step_ms"][5:]
    q = sorted(t)
    print(f"{f.stem:14s} median {st.median(t):7.1f}  q10 {q[len(q) // 10]:7.1f}  min {q[0]:7.1f} ms  "
          f"runtime host {r.get('runtime_cpu_ms')}  stall {r.get('stall_ms')}")
PY

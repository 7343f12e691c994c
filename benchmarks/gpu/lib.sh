# Shared by the GPU correctness scripts: launch one pretrain_gpt.py run per job, several jobs at a time.
# Needs: $out (result folder), $common (flags shared by every run), $nproc (GPUs per run), $port (first port - 1).

launch() {  # name model-args variant [offload-modules...]; PORT is set by batch
  local name=$1 margs=$2 variant=$3; shift 3
  local flags=""; [ $# -gt 0 ] && flags="--fine-grained-activation-offloading --offload-modules $*"
  timeout 420 torchrun --nproc-per-node "$nproc" --master-port "$PORT" benchmarks/pretrain_gpt.py $margs $common \
    $flags --label "$name $variant" --json-out "$out/${name}__${variant}.json" > "$out/${name}__${variant}.log" 2>&1 \
    || echo "RUN FAILED: $name $variant (see log)"
}

batch() {  # run the jobs concurrently (peak memory is per process; losses do not depend on it)
  for job in "$@"; do port=$((port + 1)); (PORT=$port; eval "launch $job") & done; wait
}

#!/usr/bin/env bash
# Session 27: session 25's run3.sh with the host and the GPUs sampled beside the runs, to tell what the host's slow
# periods are (hypervisor steal, other load, GPU clocks). G names the output folder; the samplers write into it, so
# run3.sh's archive carries them.
set -u
g=${G:-s1}
mkdir -p /tmp/r/$g
fields=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
nvidia-smi --query-gpu=$fields,clocks_event_reasons.active --format=csv -lms 250 > /tmp/r/$g/smi.csv 2>&1 &
smi=$!
sleep 1
if ! kill -0 $smi 2>/dev/null; then  # an older driver without clocks_event_reasons
  nvidia-smi --query-gpu=$fields --format=csv -lms 250 > /tmp/r/$g/smi.csv 2>&1 &
  smi=$!
fi
vmstat -t 1 > /tmp/r/$g/vmstat.txt 2>&1 &
vm=$!
bash benchmarks/results/issue5-session25/run3.sh
kill $smi $vm 2>/dev/null
tar czf $OUT/$g-samplers.tgz -C /tmp/r $g/smi.csv $g/vmstat.txt

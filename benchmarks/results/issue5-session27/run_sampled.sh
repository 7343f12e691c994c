#!/usr/bin/env bash
# Session 27: session 25's run3.sh with the host and the GPUs sampled beside the runs, to tell what the host's slow
# periods are (hypervisor steal, other load, GPU clocks). G names the output folder; the samplers write into it.
# DEADLINE_S (default 400): after that many seconds the runs are stopped and whatever exists is archived to
# $OUT/G-partial.tgz, so a call that runs long still brings back its finished runs (session 27's first try of this
# script ran past the device call's limit and brought back nothing). Set it at least 30 s under the call's limit.
set -u
g=${G:-s1}
deadline=${DEADLINE_S:-400}
mkdir -p /tmp/r/$g
fields=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
# once a second: NVML queries take a driver lock, and sampling much faster might itself disturb the runs
nvidia-smi --query-gpu=$fields,clocks_event_reasons.active --format=csv -l 1 > /tmp/r/$g/smi.csv 2>&1 &
smi=$!
sleep 1
if ! kill -0 $smi 2>/dev/null; then  # an older driver without clocks_event_reasons
  nvidia-smi --query-gpu=$fields --format=csv -l 1 > /tmp/r/$g/smi.csv 2>&1 &
  smi=$!
fi
vmstat -t 1 > /tmp/r/$g/vmstat.txt 2>&1 &
vm=$!
setsid bash benchmarks/results/issue5-session25/run3.sh &
runs=$!
t0=$SECONDS
while kill -0 $runs 2>/dev/null && [ $((SECONDS - t0)) -lt "$deadline" ]; do sleep 2; done
if kill -0 $runs 2>/dev/null; then
  echo "deadline ${deadline}s reached: stopping the runs, archiving what exists"
  kill -- -$runs 2>/dev/null
  sleep 2
  tar czf $OUT/$g-partial.tgz -C /tmp/r $g $( [ -f /tmp/r/$g.txt ] && echo $g.txt ) tree.txt 2>/dev/null
fi
wait $runs 2>/dev/null
kill $smi $vm 2>/dev/null
tar czf $OUT/$g-samplers.tgz -C /tmp/r $g/smi.csv $g/vmstat.txt

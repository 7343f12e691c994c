#!/usr/bin/env bash
# Session 25: install both megatron-core versions and TE, patch 0.15.3, build the C++ runtime, record the tree.
set -u
mkdir -p /tmp/r
source .gpu/w/setup.sh 0.16.1 > /tmp/r/setup.txt 2>&1
source .gpu/w/setup.sh 0.15.3 >> /tmp/r/setup.txt 2>&1
python3 -m mcore_offload patch apply --megatron-path /root/mc-0.15.3 >> /tmp/r/setup.txt 2>&1
python3 -m mcore_offload build-native >> /tmp/r/setup.txt 2>&1
{ git rev-parse HEAD 2>/dev/null || echo no-git; sha1sum mcore_offload/runtime/*.py mcore_offload/runtime/native/* \
  benchmarks/pretrain_gpt.py benchmarks/pretrain_model.py benchmarks/offload_stop.py; } > /tmp/r/tree.txt
tail -2 /tmp/r/setup.txt

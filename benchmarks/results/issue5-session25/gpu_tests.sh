#!/usr/bin/env bash
# The GPU tests, after setup.sh on this host (its tree.txt goes along).
set -u
source .gpu/w/setup.sh 0.15.3 > /dev/null 2>&1
mkdir -p /tmp/r
MCORE_OFFLOAD_MEGATRON=/root/mc-0.15.3 timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py \
  -k "${TESTS:-bitwise or forward_only or fault or side_stream}" > /tmp/r/pytest.txt 2>&1
echo "pytest rc $?" >> /tmp/r/pytest.txt
tail -3 /tmp/r/pytest.txt
tar czf $OUT/tests.tgz -C /tmp/r pytest.txt tree.txt

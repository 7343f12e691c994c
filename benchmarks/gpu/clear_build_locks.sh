#!/usr/bin/env bash
# Remove torch extension build locks that no build holds any more, so that `import megatron.core` cannot wait forever.
#
# Why: megatron-core 0.15.x compiles `managed_alloc_runtime` with torch's load_inline at every import of
# megatron.core (inference/unified_memory.py; under CUDA 13 the compile always fails, so every process builds). The
# build takes a lock file in the extensions folder; a process killed during that build (a `timeout` over a test run)
# leaves the file behind, and every later import waits on it with no message. Seen in session 63: BUDGET's timeout
# stopped issue6_pytest.sh inside a test's import, and the next two calls hung in `source .gpu/w/setup.sh` (its
# import check) until their own limits. (Our own C++ build clears its stale lock itself, under a kernel lock:
# mcore_offload/runtime/native/__init__.py.)
#
#   bash benchmarks/gpu/clear_build_locks.sh [DIR]   # on the GPU host, while no Megatron process runs (before a
#                                                    # run, after a killed one); DIR: not torch's default folder
#
# A lock is left alone while a compiler or ninja runs (a build in progress holds it rightly).
set -u
dir=${1:-$HOME/.cache/torch_extensions}
if ! command -v pgrep > /dev/null; then
  echo "clear_build_locks: pgrep is missing, so a running build cannot be told apart; locks left alone" >&2
  exit 0
fi
for tool in ninja nvcc cc1plus; do
  if pgrep -x "$tool" > /dev/null; then
    echo "clear_build_locks: $tool is running (a build in progress); locks left alone" >&2
    exit 0
  fi
done
[ -d "$dir" ] && find "$dir" -name lock -type f -print -delete | sed 's/^/clear_build_locks: removed stale /' >&2
exit 0

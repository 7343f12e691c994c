#!/usr/bin/env bash
# Remove torch extension build locks that no build holds any more, so that `import megatron.core` cannot wait forever.
#
# Why: megatron-core 0.15.x compiles `managed_alloc_runtime` with torch's load_inline when megatron.core is first
# imported (inference/unified_memory.py). The build takes a lock file in the extensions folder; a process killed
# during that build (a `timeout` over a test run) leaves the file behind, and every later import waits on it with no
# message. Seen in session 63: BUDGET's timeout stopped issue6_pytest.sh inside a test's import, and the next two
# calls hung in `source .gpu/w/setup.sh` (its import check) until their own limits.
#
#   bash benchmarks/gpu/clear_build_locks.sh     # on the GPU host, before a run, or after one was killed
#
# A lock is left alone while a compiler or ninja runs (a build in progress holds it rightly).
set -u
dir=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}
[ -d "$dir" ] || exit 0
for tool in ninja nvcc cc1plus; do
  if pgrep -x "$tool" > /dev/null; then
    echo "clear_build_locks: $tool is running (a build in progress); locks under $dir left alone" >&2
    exit 0
  fi
done
find "$dir" -name lock -type f -print -delete | sed 's/^/clear_build_locks: removed stale /' >&2

#!/usr/bin/env bash
# Pack this machine's perf for the GPU host, which has none (session 44, benchmarks/perf_steps.py): perf, the
# libraries it links (less glibc's, libstdc++ and libgcc_s, which the host has in newer versions) and two wrappers,
# into .gpu/perfpkg/perf.tar.xz (about 7 MB). Send it with the last staging piece and unpack it on the host:
#   mkdir -p /root/perfb && tar xJf .gpu/perfpkg/perf.tar.xz -C /root/perfb
# Then /root/perfb/perf/record.sh OUT CMD... records CMD (every thread, 1 ms of CPU a sample, call chains,
# CLOCK_MONOTONIC; PERF_PERIOD_NS changes the period) and /root/perfb/perf/perf.sh runs perf itself. The bundle's
# libraries are for perf only: record.sh gives the recorded command the LD_LIBRARY_PATH it had.
set -euo pipefail
cd "$(dirname "$0")/../.."
perf=$(command -v perf) || { echo "perf_bundle.sh needs perf on PATH" >&2; exit 1; }
rm -rf .gpu/perf && mkdir -p .gpu/perf/lib .gpu/perfpkg
cp "$perf" .gpu/perf/perf
for lib in $(ldd "$perf" | awk '/=>/ {print $3}'); do
  case $(basename "$lib") in
    libc.so*|libm.so*|libpthread*|libdl*|librt*|ld-linux*|libstdc++*|libgcc_s*) ;;
    *) cp -L "$lib" .gpu/perf/lib/ ;;
  esac
done
cat > .gpu/perf/record.sh <<'EOF'
#!/bin/bash
# perf record around a command (benchmarks/perf_steps.py): the bundle's libraries for perf only, not for the command
orig=${LD_LIBRARY_PATH-__unset__}
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
out=$1; shift
if [ "$orig" = __unset__ ]; then child=(env -u LD_LIBRARY_PATH); else child=(env "LD_LIBRARY_PATH=$orig"); fi
exec "$here/perf" record -q -e cpu-clock -c "${PERF_PERIOD_NS:-1000000}" -g -k mono -o "$out" -- "${child[@]}" "$@"
EOF
cat > .gpu/perf/perf.sh <<'EOF'
#!/bin/bash
here=$(cd "$(dirname "$0")" && pwd)
LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec "$here/perf" "$@"
EOF
chmod +x .gpu/perf/*.sh
tar cJf .gpu/perfpkg/perf.tar.xz -C .gpu perf
echo "perf bundle: .gpu/perfpkg/perf.tar.xz ($(du -h .gpu/perfpkg/perf.tar.xz | cut -f1))"

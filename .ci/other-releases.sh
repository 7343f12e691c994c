#!/usr/bin/env bash
# megatron-core 0.15.0, 0.15.1 and 0.15.2 (the rest of pyproject's range): each released wheel is unpacked into a
# folder of its own, patched by `mcore-offload patch apply --megatron-path`, and the megatron-facing CPU tests run
# against it (PYTHONPATH puts it before the environment's 0.15.3). Needs PyPI for the wheels; about a minute a
# release. Usage: bash .ci/other-releases.sh [VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TESTS="tests/test_patch_tooling.py tests/test_config.py tests/test_megatron_args.py tests/test_offload_megatron.py
       tests/test_offload_recompute.py tests/test_offload_parallel.py tests/test_cpu_harness_pp.py"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.15.0 0.15.1 0.15.2)
for v in "${versions[@]}"; do
  echo "== megatron-core $v"
  $PY -m pip download -q --no-deps --disable-pip-version-check -d "$work/$v/wheel" "megatron-core==$v"
  $PY -m zipfile -e "$work/$v"/wheel/megatron_core-*.whl "$work/$v/site"
  .venv/bin/mcore-offload patch apply --megatron-path "$work/$v/site"
  PYTHONPATH="$work/$v/site" $PY -c "
import megatron.core, sys
from megatron.core.package_info import __version__
sys.exit(0 if __version__ == '$v' and megatron.core.__file__.startswith('$work') else
         f'the tests would import megatron-core {__version__} from {megatron.core.__file__}, not $v')"
  # shellcheck disable=SC2086  # TESTS is a list of paths
  PYTHONPATH="$work/$v/site" $PY -m pytest -q -p no:cacheprovider $TESTS
done

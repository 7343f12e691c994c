"""Run ``pretrain_gpt.py`` on a machine without a GPU (gloo, local spec), for the demo and CI smoke runs.

    torchrun --nproc-per-node 1 benchmarks/cpu_launch.py --transformer-impl local ...

megatron-core 0.15.3 calls CUDA in a few places even on CPU; the test harness's shims
(``tests/harness/cpu_shims.py``) replace exactly those calls. They are test-only code, never used on a GPU.
"""

import os
import runpy
import sys
from pathlib import Path

# The CPU smoke runs compare losses bit for bit between processes. MKL's GEMM may take code paths that depend on
# memory alignment unless its reproducibility mode is strict (fixing the branch moved these losses' low bits here,
# and CI saw rare step-0/1 differences in plain runs and offloaded runs alike; the strict mode is the remedy Intel
# documents, not yet shown to remove them). One thread each, for the same reason: a GEMM's or a reduction's split
# across threads can follow the thread count MKL or OpenMP settles on at run time, and the tiny model gains nothing
# from a second thread. Set before torch loads MKL; an explicit setting wins.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

root = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(root))

from tests.harness.cpu_shims import install_cpu_shims  # noqa: E402

install_cpu_shims()
sys.argv = [str(root / "benchmarks" / "pretrain_gpt.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")

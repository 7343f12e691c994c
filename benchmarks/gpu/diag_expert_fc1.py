"""Why does expert_fc1 offload nothing with TEGroupedMLP? Print what the point's saved tensors look like.

    torchrun --nproc-per-node 1 benchmarks/gpu/diag_expert_fc1.py <pretrain_gpt.py flags>
"""

import runpy
import sys
from pathlib import Path

from mcore_offload.runtime import handler

seen = []
original = handler.ChunkOffloadHandler.ineligible_reason


def reason(self, t):
    why = original(self, t)
    if len(seen) < 40:
        seen.append(1)
        st = t.untyped_storage()
        print(f"DIAG type={type(t).__name__} shape={tuple(t.shape)} dtype={t.dtype} numel={t.numel()} "
              f"storage_bytes={st.nbytes()} offset={t.storage_offset()} base={t._base is not None} -> {why}")
    return why


handler.ChunkOffloadHandler.ineligible_reason = reason
root = Path(__file__).resolve().parents[2]
sys.argv = [str(root / "benchmarks" / "pretrain_gpt.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")

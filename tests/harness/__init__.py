"""CPU test harness for megatron-core 0.15.3 GPTModels (gloo, no GPU needed).

See README.md in this directory for what is shimmed and why.
"""


def require_cpu_only_torch() -> None:
    """Skip the calling test on a machine with CUDA: there megatron-core puts some tensors on the GPU that the CPU
    shims never see, and the harness's models fail with device mismatches (seen on the GPU host)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU test harness needs a machine without CUDA; on the GPU host run the GPU tests "
                    "(pytest -m gpu tests/test_gpu.py)")

"""Shared fixtures. The test environment's megatron-core is patched (``make test`` runs
``mcore-offload patch apply`` first); patch-tooling tests work on private copies."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from mcore_offload.patching import tooling


@pytest.fixture(scope="session")
def pristine_megatron(tmp_path_factory) -> Path:
    """A private, unpatched copy of the installed megatron-core (root directory holding megatron/)."""
    install = tooling.find_megatron()
    root = tmp_path_factory.mktemp("pristine")
    shutil.copytree(install.root / "megatron", root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    copy = tooling.MegatronInstall(root=root, version=install.version)
    tooling.revert_patches(copy)  # the environment's copy may be patched
    return root


@pytest.fixture
def megatron_copy(pristine_megatron, tmp_path) -> tooling.MegatronInstall:
    """A fresh unpatched copy per test."""
    shutil.copytree(pristine_megatron / "megatron", tmp_path / "megatron")
    return tooling.find_megatron(tmp_path)


@pytest.fixture(autouse=True)
def _reset_offload_state():
    """No offload state leaks between tests (ours, and megatron's global MoE aux-loss tracker, which is
    sized by the first MoE model a process builds)."""
    yield
    from mcore_offload.runtime.manager import reset

    reset()
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


@pytest.fixture(params=["native", "python"])
def hook_impl(request, monkeypatch) -> str:
    """Run the test with the C++ saved-tensor hooks (``MCORE_OFFLOAD_NATIVE=1``: they must build here) and again with
    the Python ones; the manager made in the test reads the setting."""
    from mcore_offload.runtime import native
    from mcore_offload.runtime.manager import reset

    if request.param == "native" and native.toolchain_missing():
        pytest.skip(f"the C++ hooks cannot be built here: {native.toolchain_missing()}")
    reset()
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1" if request.param == "native" else "0")
    yield request.param
    reset()
    native.reset()


def record_packed(monkeypatch, seen: list) -> None:
    """Append a weak reference to every tensor an offload block's pack hook receives (either implementation)."""
    import weakref

    import torch

    from mcore_offload.runtime import points

    def recorded(pack):
        def pack_and_record(tensor):
            seen.append(weakref.ref(tensor))
            return pack(tensor)

        return pack_and_record

    # blocks push their hooks with torch's private call where it exists, else through the context manager
    real = torch.autograd.graph.saved_tensors_hooks
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", lambda pack, unpack: real(recorded(pack), unpack))
    if points._push_hooks is not None:
        real_push = points._push_hooks
        monkeypatch.setattr(points, "_push_hooks", lambda pack, unpack: real_push(recorded(pack), unpack))


@pytest.fixture(scope="module")
def native_stub_runtime(tmp_path_factory):
    """The logging stub CUDA runtime (``benchmarks/cpu_transport_glue.py``, copies made for real) for tests of the C++
    runtime against the Python one; skipped where the stub or the C++ runtime cannot be built."""
    from mcore_offload.runtime import native

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import cpu_transport_glue

    if cpu_transport_glue.compiler() is None:
        pytest.skip("no C compiler for the stub CUDA runtime")
    if native.toolchain_missing():
        pytest.skip(f"the C++ runtime cannot be built here: {native.toolchain_missing()}")
    return cpu_transport_glue.stub_runtime(tmp_path_factory.mktemp("stub"), real_copies=True, log=True)

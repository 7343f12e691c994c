"""benchmarks/native_pause.py: the plain steps of an alternating run on upstream's native offloading.

megatron-core 0.16 is not installed on CPU, so the modules here carry the attributes its constructors set.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from native_pause import NativePause  # noqa: E402


class _Attention(torch.nn.Module):
    def __init__(self, config: SimpleNamespace, core: bool) -> None:
        super().__init__()
        self.config = config
        self.offload_qkv_linear = False  # a point the config does not name: left alone
        self.offload_core_attention = core


def _model(core: bool = True) -> tuple[torch.nn.Module, SimpleNamespace]:
    config = SimpleNamespace(fine_grained_activation_offloading=True)
    model = torch.nn.Sequential(_Attention(config, core), _Attention(config, core))
    model.config = config
    return model, config


def test_paused_turns_every_switch_off_and_back_on():
    model, config = _model()
    pause = NativePause([model])
    with pause.paused():
        assert config.fine_grained_activation_offloading is False
        assert [m.offload_core_attention for m in model] == [False, False]
    assert config.fine_grained_activation_offloading is True
    assert [m.offload_core_attention for m in model] == [True, True]
    assert [m.offload_qkv_linear for m in model] == [False, False]  # was off: stays off


def test_paused_restores_when_the_step_raises():
    model, config = _model()
    pause = NativePause([model])
    with pytest.raises(RuntimeError), pause.paused():
        raise RuntimeError("step failed")
    assert config.fine_grained_activation_offloading is True
    assert all(m.offload_core_attention for m in model)


def test_no_native_switch_is_one_sentence():
    model, _ = _model(core=False)
    with pytest.raises(ValueError, match="found no module with native offloading switched on"):
        NativePause([model])

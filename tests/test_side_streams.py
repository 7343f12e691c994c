"""MCORE_OFFLOAD_SIDE_STREAMS: which streams the transport copies on (no GPU here: torch.cuda.Stream is faked)."""

from __future__ import annotations

import pytest
import torch

from mcore_offload.runtime import side_streams


class FakeStream:
    made: list[FakeStream] = []

    def __init__(self, device=None, priority: int = 0) -> None:
        self.device, self.priority = device, priority
        FakeStream.made.append(self)


@pytest.fixture
def fake_streams(monkeypatch):
    FakeStream.made = []
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    return FakeStream.made


@pytest.mark.parametrize("kind, queues, taken, priority", [
    (None, None, 2, 0),  # the default: two pooled streams, as before
    ("pool", "4", 2, 0),
    ("aligned", None, 8, 0),  # one per hardware queue (8 unless CUDA_DEVICE_MAX_CONNECTIONS says otherwise)
    ("aligned", "16", 16, 0),
    ("aligned", "1", 2, 0),  # never fewer than the two it uses
    ("aligned", "junk", 8, 0),  # the driver ignores a value it cannot read; so do we
    ("high-priority", None, 2, -1),
])
def test_side_streams_take_the_streams_their_kind_names(monkeypatch, fake_streams, kind, queues, taken, priority):
    if kind is None:
        monkeypatch.delenv("MCORE_OFFLOAD_SIDE_STREAMS", raising=False)
    else:
        monkeypatch.setenv("MCORE_OFFLOAD_SIDE_STREAMS", kind)
    if queues is not None:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", queues)
    d2h, h2d = side_streams.make_side_streams(torch.device("cuda", 1))
    assert len(fake_streams) == taken
    assert (d2h, h2d) == (fake_streams[0], fake_streams[1]) and d2h is not h2d
    assert all(s.priority == priority and s.device == torch.device("cuda", 1) for s in fake_streams)


def test_a_bad_side_stream_kind_is_one_sentence_before_any_stream(monkeypatch, fake_streams):
    monkeypatch.setenv("MCORE_OFFLOAD_SIDE_STREAMS", "fast")
    with pytest.raises(ValueError, match=r"^MCORE_OFFLOAD_SIDE_STREAMS='fast' is not a side-stream kind: set it to "
                                         r"'pool' \(the default\), 'aligned' or 'high-priority', or unset it$"):
        side_streams.make_side_streams(torch.device("cuda", 0))
    assert fake_streams == []

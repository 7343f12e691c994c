"""How long a reloaded storage lives in backward: until the last autograd node that reads it is done, as the
original would without offloading, not until the end of its offload point's group (handler._first_read)."""

from __future__ import annotations

import weakref

import pytest
import torch

from mcore_offload.runtime import points
from mcore_offload.runtime.transport import Transport
from mcore_offload.summary import get_summary
from tests.conftest import record_packed
from tests.test_runtime_unit import Toy, cfg, train_step

# every test here runs with the C++ hooks and with the Python ones
pytestmark = pytest.mark.usefixtures("hook_impl")


def spy_reloads(monkeypatch) -> list[tuple[int, weakref.ref]]:
    """Every storage a reload burst makes, as (bytes, weak reference)."""
    made: list[tuple[int, weakref.ref]] = []
    to_device = Transport.to_device

    def spied(self, hosts, sizes, *args, **kwargs):
        storages, events = to_device(self, hosts, sizes, *args, **kwargs)
        made.extend((s.nbytes(), weakref.ref(s)) for s in storages)
        return storages, events

    monkeypatch.setattr(Transport, "to_device", spied)
    return made


class Probe(torch.autograd.Function):
    """An identity whose backward notes the sizes of the reloaded storages still alive at that moment."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


class ThreeReaders(Toy):
    """A group of several autograd nodes, like the local spec's attention: three tanhs, each saving its output
    (rows x 16, x 32 and x 48 float32: 512, 1024 and 1536 bytes at 8 rows), read one after another in backward.
    ``measure()`` is noted at two moments of each layer's backward (``notes``). ``second_point``: a tanh at the
    ``mlp_norm`` point after them (then the kept layer's ``core_attn`` group is not the first group backward
    reaches, which the C++ runtime's common path serves)."""

    def __init__(self, config, measure, rows=8, second_point=False):
        super().__init__(config, layers=2)  # the first layer is offloaded, the last one stays on the device
        self.measure, self.rows, self.notes, self.calls = measure, rows, [], 0
        self.second_point = second_point
        self.made: list[tuple[str, int, weakref.ref]] = []  # the tanh outputs' storages: (layer, bytes, weakref)

    def note(self, where):
        def record():
            alive = [(layer, n) for layer, n, ref in self.made if ref() is not None]
            self.notes.append((where, self.measure(), alive))
        return record

    def keep_track(self, tag, *tensors):
        self.made.extend((tag, t.untyped_storage().nbytes(), weakref.ref(t.untyped_storage())) for t in tensors)

    def layer(self, x, qkv, proj):
        points.layer_boundary(self.config)
        self.calls += 1
        tag = f"layer {self.calls}"
        with points.offload("core_attn", self.config, x) as h:
            y1 = torch.tanh(Probe.apply(h, self.note(f"{tag}: group start")))
            y1c = Probe.apply(y1, self.note(f"{tag}: after the second and third tanh"))
            y2 = torch.tanh(torch.cat([y1c, y1c], -1))
            y3 = torch.tanh(torch.cat([y2, y1c], -1))
            self.keep_track(tag, y1, y2, y3)
        out = points.commit("core_attn", self.config, y3[..., :16])
        if self.second_point:
            with points.offload("mlp_norm", self.config, out) as o:
                out = torch.tanh(o)
            out = points.commit("mlp_norm", self.config, out)
        return x + out


def run_three_readers(names, measure, rows=8, device="cpu", second_point=False):
    """One training step of :class:`ThreeReaders`: the model (its notes), the loss and the input's gradient."""
    model = ThreeReaders(cfg(*names), measure, rows, second_point).to(device)
    x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    loss = train_step(model, [x])[0]
    return model, loss, x.grad


@pytest.mark.parametrize("second_point", [False, True], ids=["one-group", "two-groups"])
def test_a_reloaded_storage_goes_when_its_last_reader_is_done_not_at_the_end_of_its_group(monkeypatch, second_point):
    made = spy_reloads(monkeypatch)

    def alive():
        return sorted(n for n, ref in made if ref() is not None)

    names = ["core_attn", "mlp_norm"] if second_point else ["core_attn"]
    base_model, base_loss, base_grad = run_three_readers([], alive, second_point=second_point)
    assert made == [] and base_model.notes
    model, loss, grad = run_three_readers(names, alive, second_point=second_point)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    # the first layer's storages came back once: the three tanhs' (and the second point's, read before them)
    assert sorted(n for n, _ in made) == ([512, 512, 1024, 1536] if second_point else [512, 1024, 1536])
    layer1 = [(where, got) for where, got, _ in model.notes if where.startswith("layer 1")]
    # Between the second and the first tanh's backward only the first tanh's output is still needed. (Held until the
    # group's end, all three were alive here and at the group's start.)
    assert layer1 == [("layer 1: after the second and third tanh", [512]), ("layer 1: group start", [])]
    # The tanh outputs themselves: the offloaded layer's are gone since its flush; the last layer's, kept on the
    # device, go with their readers, as without offloading (the group used to hold them to the chunk's end).
    expected = {"layer 2: after the second and third tanh": [("layer 2", 512)], "layer 2: group start": [],
                "layer 1: after the second and third tanh": [], "layer 1: group start": []}
    assert {where: alive for where, _, alive in model.notes} == expected
    assert {where: alive for where, _, alive in base_model.notes} == {
        "layer 2: after the second and third tanh": [("layer 1", 512), ("layer 1", 1024), ("layer 1", 1536),
                                                     ("layer 2", 512)],
        "layer 2: group start": [("layer 1", 512), ("layer 1", 1024), ("layer 1", 1536)],
        "layer 1: after the second and third tanh": [("layer 1", 512)], "layer 1: group start": []}
    last = get_summary().last_step
    assert last.total("offloaded") == last.total("reloaded") == 512 * second_point + 512 + 1024 + 1536


class ReadsTwice(torch.autograd.Function):
    """Reads its saved input twice in backward, as megatron's CheckpointWithoutOutput does (recompute, then
    backward); ``keep``: whether the first read's tensor is still held at the second."""

    @staticmethod
    def forward(ctx, x, keep):
        ctx.keep = keep
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        first = ctx.saved_tensors[0]
        held = first if ctx.keep else None
        del first
        (x,) = ctx.saved_tensors
        assert held is None or held.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        return grad * x.cos(), None


class TwoReads(Toy):
    def __init__(self, config, keep):
        super().__init__(config, layers=2)
        self.keep = keep

    def layer(self, x, qkv, proj):
        points.layer_boundary(self.config)
        with points.offload("core_attn", self.config, x) as h:
            y = ReadsTwice.apply(h * 3.0, self.keep)  # the product's storage: saved by ReadsTwice alone
        return x + points.commit("core_attn", self.config, y)


@pytest.mark.parametrize("keep", [True, False])
def test_a_second_read_finds_the_storage_or_brings_it_back_again(keep):
    """The second read of a view finds the storage through the entry's weak reference while the first read's
    tensor holds it; once nothing does, it reloads the host copy again (more link time, the same values)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
    base_loss = train_step(TwoReads(cfg(), keep), [x])[0]
    base_grad, x.grad = x.grad, None
    loss = train_step(TwoReads(cfg("core_attn"), keep), [x])[0]
    assert torch.equal(loss, base_loss) and torch.equal(x.grad, base_grad)
    last = get_summary().last_step
    assert last.total("offloaded") == 512  # the first layer's product (8x16 float32)
    assert last.total("reloaded") == (512 if keep else 2 * 512)


class Fault(torch.autograd.Function):
    """An identity whose backward raises (a fault in the middle of backward, after the kept layer's groups began)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected backward fault")


class FaultInGroup(Toy):
    """Two layers of a tanh pair at ``core_attn`` and a tanh at ``mlp_norm``; the last (kept) layer's backward raises
    between its two ``core_attn`` tanhs, so the first tanh's saved output is never read."""

    def __init__(self, config):
        super().__init__(config, layers=2)
        self.calls = 0

    def layer(self, x, qkv, proj):
        points.layer_boundary(self.config)
        self.calls += 1
        with points.offload("core_attn", self.config, x) as h:
            y = torch.tanh(h)
            y = torch.tanh(Fault.apply(y) if self.calls == 2 else y)
        out = points.commit("core_attn", self.config, y)
        with points.offload("mlp_norm", self.config, out) as o:
            out = torch.tanh(o)
        return x + points.commit("mlp_norm", self.config, out)


def test_a_fault_in_backward_frees_every_saved_tensor_without_the_garbage_collector(monkeypatch):
    """Groups let go of their saved refs when backward reaches them, yet an abort must still cut loose the refs the
    abandoned graph holds: a saved output and its SavedRef form a cycle through the autograd graph that the
    collector cannot see."""
    import gc

    seen: list = []
    record_packed(monkeypatch, seen)
    model = FaultInGroup(cfg("core_attn", "mlp_norm"))
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="injected backward fault"):
            train_step(model, [torch.randn(8, 16, requires_grad=True)])
        assert get_summary().last_step.aborted
        assert seen and [r for r in seen if r() is not None] == []
    finally:
        gc.enable()
    model = FaultInGroup(cfg("core_attn", "mlp_norm"))
    model.calls = -10  # no fault this time
    train_step(model, [torch.randn(8, 16, requires_grad=True)])
    assert not get_summary().last_step.aborted and get_summary().last_step.total("offloaded") > 0

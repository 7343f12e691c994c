"""The handler and manager on a toy model (no megatron): exact values, exact bytes, no leftover state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mcore_offload.runtime import points
from mcore_offload.runtime.manager import get_manager
from mcore_offload.summary import get_summary
from tests.conftest import record_packed

# every test here runs with the C++ hooks and with the Python ones
pytestmark = pytest.mark.usefixtures("hook_impl")


def cfg(*names, min_size=0):
    return SimpleNamespace(fine_grained_activation_offloading=bool(names),
                           offload_modules=list(names), min_offloaded_tensor_size=min_size)


class Toy(torch.nn.Module):
    """Layers shaped like a transformer layer's attention: fused qkv projection, attention, projection."""

    def __init__(self, config, layers=3, hidden=16):
        super().__init__()
        torch.manual_seed(0)
        self.config = config
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(hidden, 3 * hidden) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x):
        points.begin_chunk(self.config, None, self)
        for qkv, proj in zip(self.qkv, self.proj):
            x = self.layer(x, qkv, proj)  # one call per layer: its locals die at return, as in megatron
        return x.square().mean()

    def layer(self, x, qkv, proj):
        points.layer_boundary(self.config)
        with points.offload("qkv_linear", self.config, x) as h:
            mixed = qkv(torch.tanh(h))
        mixed = points.commit("qkv_linear", self.config, mixed)
        q, k, v = mixed.split(mixed.shape[-1] // 3, dim=-1)  # aliasing views of one storage
        with points.offload("core_attn", self.config, q) as q:
            att = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        att = points.commit("core_attn", self.config, att)
        with points.offload("attn_proj", self.config, att) as att:
            out = proj(att)
        return x + points.commit("attn_proj", self.config, out)


@points.step_boundary
def train_step(model, inputs):
    losses = []
    for x in inputs:
        loss = model(x)
        loss.backward()
        losses.append(loss.detach())
    return losses


def toy_steps(model, steps=2, microbatches=2, step_fn=None, shape=(8, 16), device=None):
    """Losses and gradients of ``steps`` training steps of the toy (``step_fn``: how a step runs its microbatches,
    :func:`train_step` by default), on the same seeded inputs every time (``shape``, made on the CPU and moved to
    ``device``)."""
    step_fn = step_fn or train_step
    results = []
    for step in range(steps):
        model.zero_grad()
        inputs = [torch.randn(*shape, generator=torch.Generator().manual_seed(10 * step + i)).to(device)
                  for i in range(microbatches)]
        results.append((step_fn(model, inputs), [p.grad.clone() for p in model.parameters()]))
    return results


def run(names, steps=2, microbatches=2):
    return toy_steps(Toy(cfg(*names)), steps, microbatches)


@pytest.mark.parametrize("names", [["qkv_linear"], ["core_attn"], ["core_attn", "attn_proj"],
                                   ["qkv_linear", "core_attn", "attn_proj"]])
def test_bitwise_equal_and_bytes_accounted(names):
    base = run([])
    got = run(names)
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    last = get_summary().last_step
    assert last is not None and not last.aborted
    offloaded = last.total("offloaded")
    assert offloaded > 0
    assert last.total("released_in_forward") == offloaded
    assert last.total("reloaded") == offloaded
    # the last layer's groups turn around at once: kept on the device, never copied
    assert last.total("kept_on_device") > 0
    assert get_summary().host_resident_bytes == 0
    assert not get_manager().handlers


def test_q_k_v_views_share_one_host_copy():
    run(["core_attn"], steps=1, microbatches=1)
    # core_attn saves q, k (views of the fused qkv output), the softmax output and v; q/k/v's storage
    # is copied once: 2 offloaded layers x (qkv storage 8x48 + softmax 8x8 + ...) in float32
    per_layer = get_summary().last_step.points["core_attn"]["offloaded"] / 2
    assert per_layer == (8 * 48 + 8 * 8) * 4


def test_no_grad_and_eval_offload_nothing():
    model = Toy(cfg("core_attn"))
    with torch.no_grad():
        model(torch.randn(8, 16))
    model.eval()
    model(torch.randn(8, 16)).backward()
    assert get_summary().last_step is None
    assert get_manager().forward_handler is None


def test_min_size_keeps_small_tensors():
    model = Toy(cfg("core_attn", min_size=10_000))
    train_step(model, [torch.randn(8, 16)])
    assert get_summary().last_step is None


def test_exception_mid_forward_leaves_no_state():
    model = Toy(cfg("qkv_linear", "core_attn"))

    @points.step_boundary
    def failing_step(x):
        model(x).backward()
        model(x)  # builds groups, then fails before backward
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        failing_step(torch.randn(8, 16))
    manager = get_manager()
    assert not manager.handlers and manager.forward_handler is None and not manager.open_groups
    assert get_summary().last_step.aborted
    assert get_summary().host_resident_bytes == 0
    # the next step trains, offloads, and matches a clean run bit for bit
    model.zero_grad()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    loss = train_step(model, [x])[0]
    assert get_summary().last_step.total("offloaded") > 0 and not get_summary().last_step.aborted
    ref = Toy(cfg())
    ref_loss = train_step(ref, [x])[0]
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


def test_nothing_saved_outlives_the_step_without_the_garbage_collector(monkeypatch):
    """Kept, skipped and offloaded tensors are all freed by reference counting when the step ends
    (a reference cycle here leaked ~300 MiB per microbatch on the GPU host until gc ran)."""
    import gc

    seen = []
    record_packed(monkeypatch, seen)
    model = Toy(cfg("qkv_linear", "core_attn", "attn_proj"))
    gc.collect()
    gc.disable()
    try:
        train_step(model, [torch.randn(8, 16), torch.randn(8, 16)])
        assert seen and get_summary().last_step.total("kept_on_device") > 0
        alive = [r for r in seen if r() is not None]
        assert alive == []
    finally:
        gc.enable()


def test_storage_held_elsewhere_is_not_copied():
    """A storage that a live tensor outside the group still holds frees nothing: it stays on device."""

    class Keeper(Toy):
        def layer(self, x, qkv, proj):
            points.layer_boundary(self.config)
            self.kept = torch.tanh(x)  # alive after the layer returns, like a tensor saved elsewhere
            with points.offload("qkv_linear", self.config, self.kept) as h:
                mixed = qkv(torch.sin(h))  # sin saves h (held elsewhere), qkv saves sin(h) (ours alone)
            return x + points.commit("qkv_linear", self.config, mixed)[..., :16]

    model = Keeper(cfg("qkv_linear"))
    for _ in range(2):
        train_step(model, [torch.randn(8, 16)])
    last = get_summary().last_step.points["qkv_linear"]
    # 3 layers, the last one kept on the device: two layers flushed, 8x16 float32 tensors each; sin
    # saves its input only where it needs a grad (layer 2: the input of layer 1 needs none)
    assert last["offloaded"] == 2 * 8 * 16 * 4 and last["skipped_aliased"] == 8 * 16 * 4
    assert last["released_in_forward"] == last["offloaded"]


def _one_ref_cases():
    """(name, SavedRef, what else keeps alive, expected answer); no test-frame name refers to the saved tensor."""
    from mcore_offload.runtime.saved import Group, SavedRef

    group = Group("qkv_linear")
    sole = SavedRef(torch.randn(64), group, "qkv_linear")
    aliased = SavedRef(torch.randn(64), group, "qkv_linear")
    named = SavedRef(torch.randn(64), group, "qkv_linear")
    view = SavedRef(torch.randn(8, 8)[2:], group, "qkv_linear")  # its base lives only through the view
    base_kept = torch.randn(8, 8)
    view_of_kept = SavedRef(base_kept[2:], group, "qkv_linear")
    return [
        ("sole tensor", sole, None, False),
        ("another tensor on the storage", aliased, aliased.tensor.view(8, 8), True),
        ("the same tensor object named elsewhere", named, [named.tensor], True),
        ("a view whose base nobody else holds", view, None, False),
        ("a view whose base Python still holds", view_of_kept, base_kept, True),
    ]


def test_the_one_reference_fast_path_answers_like_the_general_check():
    from mcore_offload.runtime.saved import held_by_other_than_many, held_by_other_than_one

    for case in _one_ref_cases():  # the case tuple is the only extra holder of its keeper: one reference
        name, ref, expected = case[0], case[1], case[3]
        storage = ref.tensor.untyped_storage()
        assert held_by_other_than_one(storage, ref) is expected, name
        assert held_by_other_than_many(storage, [ref]) is expected, name


class _GroupedGemm(torch.autograd.Function):
    """Saves what TE 2.9's ``_GroupedLinear`` saves without FP8: one split view of the input per expert
    (such views report requires_grad and is_leaf once saved), the weights and empty biases."""

    @staticmethod
    def forward(ctx, inp, splits, *weights):
        mats = torch.split(inp.reshape(-1, inp.shape[-1]), splits)
        ctx.save_for_backward(*mats, *weights)
        ctx.n = len(splits)
        return torch.cat([m @ w.t() for m, w in zip(mats, weights)])

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        mats, weights = saved[: ctx.n], saved[ctx.n :]
        grads = torch.split(grad, [m.shape[0] for m in mats])
        dinp = torch.cat([g @ w for g, w in zip(grads, weights)])
        return (dinp, None, *[g.t() @ m for g, m in zip(grads, mats)])


def test_grouped_gemm_split_views_are_offloaded():
    """The per-expert views share the permuted tokens' storage: that storage moves, once, and the result
    is bitwise the no-offload one (on the GPU this point offloaded nothing before)."""

    class Experts(Toy):
        def __init__(self, config):
            super().__init__(config)
            self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(16, 16)) for _ in range(4))

        def layer(self, x, qkv, proj):
            points.layer_boundary(self.config)
            tokens = torch.tanh(x).repeat(2, 1)  # the permuted tokens: a fresh storage, top-2
            with points.offload("expert_fc1", self.config, tokens) as h:
                out = _GroupedGemm.apply(h, [4, 4, 2, 6], *self.w)
            out = points.commit("expert_fc1", self.config, out)
            return x + out[:8] + out[8:]

    def once(names):
        model = Experts(cfg(*names))
        loss = train_step(model, [torch.randn(8, 16, generator=torch.Generator().manual_seed(5))])[0]
        return loss, [p.grad for p in model.parameters() if p.grad is not None]

    base_loss, base_grads = once([])
    loss, grads = once(["expert_fc1"])
    assert torch.equal(loss, base_loss) and all(torch.equal(a, b) for a, b in zip(grads, base_grads))
    last = get_summary().last_step.points["expert_fc1"]
    assert last["offloaded"] == 2 * 16 * 16 * 4  # two flushed layers x one 16x16 float32 token storage
    assert last["released_in_forward"] == last["offloaded"] == last["reloaded"]


def test_a_saved_tensor_and_a_saved_view_of_it_move_together():
    """core_attn saves attention's output, attn_proj saves a reshape of it: one storage, ours alone."""

    class Shared(Toy):
        def layer(self, x, qkv, proj):
            points.layer_boundary(self.config)
            with points.offload("core_attn", self.config, x) as h:
                out = torch.exp(qkv(h)[..., :16])  # exp saves its output
            out = points.commit("core_attn", self.config, out)
            with points.offload("attn_proj", self.config, out) as o:
                y = proj(o.view(-1, 16))  # the linear saves a view of that output
            return x + points.commit("attn_proj", self.config, y)

    model = Shared(cfg("core_attn", "attn_proj"))
    train_step(model, [torch.randn(8, 16)])
    last = get_summary().last_step
    # Two flushed layers. exp's output storage (8x16 float32) moves in both; the layer input saved by the
    # qkv linear moves in layer 2 only: layer 1's input is still held by the caller (skipped, rightly).
    tile = 8 * 16 * 4
    assert last.points["core_attn"]["offloaded"] == 3 * tile
    assert last.total("skipped_aliased") == tile
    assert last.total("released_in_forward") == last.total("offloaded") == last.total("reloaded")


def test_peak_attribution_reports_the_bytes_off_the_device_when_the_peak_rose():
    """The benchmark's R: off-device bytes at the moment of the device peak, not their high-water mark."""
    fake_peak = {"bytes": 0}

    class PeakAtLoss(Toy):
        def forward(self, x):
            loss = super().forward(x)
            fake_peak["bytes"] += 1  # the device peak rises here: after the last layer, before backward
            return loss

    model = PeakAtLoss(cfg("qkv_linear", "core_attn"))
    summary = get_summary()
    summary.track_peak(lambda: fake_peak["bytes"])
    train_step(model, [torch.randn(8, 16)])
    summary.stop_tracking_peak()
    last = summary.last_step
    # one microbatch: everything released in forward is off the device when the loss is computed
    assert summary.off_device_at_peak_bytes == last.total("released_in_forward") > 0
    assert summary.off_device_bytes == 0  # all reloaded by the end of backward


def test_pinned_buffers_are_allocated_in_the_first_step_only():
    model = Toy(cfg("qkv_linear", "core_attn", "attn_proj"))
    for step in range(3):
        train_step(model, [torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) for _ in range(2)])
    counts = [s.host_buffer_allocations for s in get_summary().steps]
    assert counts[0] > 0 and counts[1:] == [0, 0]


def test_interrupt_mid_step_releases_everything():
    """Ctrl-C inside a forward (KeyboardInterrupt is not an Exception) leaves no handler and no host bytes."""
    model = Toy(cfg("qkv_linear", "core_attn"))

    @points.step_boundary
    def interrupted_step(x):
        model(x).backward()
        model(x)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted_step(torch.randn(8, 16))
    manager = get_manager()
    assert not manager.handlers and manager.forward_handler is None
    assert get_summary().last_step.aborted and get_summary().host_resident_bytes == 0
    train_step(model, [torch.randn(8, 16)])
    assert get_summary().last_step.total("offloaded") > 0 and not get_summary().last_step.aborted


def test_exception_inside_a_point_frees_what_the_point_saved(monkeypatch):
    """A fault inside an offload block (found on the GPU host: the toy leaked a few MiB per fault): the open
    group's saved tensors sit in a cycle through the autograd graph (GroupStart's ctx -> group -> saved refs ->
    tensors -> grad_fn -> GroupStart), which the garbage collector cannot see; the abort must break it."""
    import gc

    saved = []
    record_packed(monkeypatch, saved)  # core_attn is the only point on
    config = cfg("core_attn")
    models = [Toy(config, hidden=64)]

    def failing_layer(x, qkv, proj):
        points.layer_boundary(config)
        mixed = qkv(torch.tanh(x))
        q, k, v = mixed.split(mixed.shape[-1] // 3, dim=-1)
        with points.offload("core_attn", config, q) as q:
            torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
            raise RuntimeError("injected inside the point")

    models[0].layer = failing_layer

    @points.step_boundary
    def step(x):
        models[0](x)

    with pytest.raises(RuntimeError, match="inside the point"):
        step(torch.randn(8, 64, requires_grad=True))
    models.clear()
    gc.collect()
    assert saved and all(r() is None for r in saved), f"{sum(r() is not None for r in saved)} saved tensors alive"


def test_coverage_counts_each_saved_byte_range_once_and_stops_at_the_threshold():
    from mcore_offload.runtime.saved import SavedRef, covers

    base = torch.zeros(1600)  # 6400 bytes
    experts = [SavedRef(v, None, "expert_fc1") for v in torch.split(base, 100)]  # 16 views, one per expert
    assert covers(experts, 0.5 * 6400)
    assert not covers(experts[:7], 0.5 * 6400)  # 7 of 16 views: 2800 bytes
    same = [SavedRef(base[:400], None, "core_attn") for _ in range(8)]  # one view saved 8 times: 1600 bytes
    assert not covers(same, 0.5 * 6400)
    as_bytes = [SavedRef(base[:400].view(torch.uint8), None, "core_attn"), SavedRef(base[:400], None, "core_attn")]
    assert not covers(as_bytes, 1601)  # the same bytes seen as another dtype count once too


def test_parameter_storages_are_walked_in_the_first_two_steps_then_kept(monkeypatch):
    from mcore_offload.runtime import manager as manager_module

    walks = []
    real = manager_module._parameter_storages

    def counting(model):
        walks.append(id(model))
        return real(model)

    monkeypatch.setattr(manager_module, "_parameter_storages", counting)
    base = run([], steps=4)
    got = run(["core_attn"], steps=4)  # 4 steps x 2 microbatches: 8 chunk starts
    assert len(walks) == 2
    for (l0, g0), (l1, g1) in zip(base, got):
        assert all(torch.equal(a, b) for a, b in zip(l0 + g0, l1 + g1))
    # a protected storage stays on the device even when the set is no longer refreshed
    assert get_summary().steps[-1].total("offloaded") == get_summary().steps[0].total("offloaded") > 0


def test_a_changed_offload_modules_list_is_seen_by_the_next_chunk():
    from mcore_offload.runtime.enabled import enabled_points_cached

    config = cfg("core_attn")
    assert enabled_points_cached(config) == frozenset({"core_attn"})
    config.offload_modules = ["core_attn", "attn_proj"]
    assert enabled_points_cached(config) == frozenset({"core_attn", "attn_proj"})


def test_the_saved_nothing_line_names_the_usual_cause():
    """A point that saved nothing offloadable is logged once with its reasons; a norm's line says the TE spec fuses
    it, and a line with tensors under the size threshold says how to move them (a SequentialMLP's fine-grained
    experts each save a small fc1 output of their own)."""
    from mcore_offload.runtime.saved import saved_nothing_line

    norm = saved_nothing_line("mlp_norm", {})
    assert norm.startswith("offload point mlp_norm saved no tensor that can be offloaded here (none saved)")
    assert "fused into the next linear" in norm and "min_offloaded_tensor_size" not in norm
    act = saved_nothing_line("moe_act", {"under min_offloaded_tensor_size": 64, "parameter": 2})
    assert "(2 parameter, 64 under min_offloaded_tensor_size)" in act
    assert act.endswith("lower min_offloaded_tensor_size to offload the small ones") and "fused" not in act

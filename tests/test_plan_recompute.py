"""The planner under activation recompute: selective recompute (what each recomputed module keeps and which
points it rules out, refused as a run refuses them) and full recompute (the uniform and block methods)."""

from __future__ import annotations

import pytest

from mcore_offload.cli import build_parser, main
from mcore_offload.plan import ParallelLayout, layer_activations
from mcore_offload.plan.cli import config_from_args
from tests.test_plan import DENSE, MIB, MOE, moved, plan_for, training


def test_recompute_interaction():
    def acts(model, modules, moe, granularity="selective"):
        return layer_activations(model, ParallelLayout(), training(recompute_granularity=granularity,
                                                                   recompute_modules=modules), moe=moe)

    core = acts(DENSE, ("core_attn",), False)
    assert core.points["core_attn"].offloaded_bytes == 0
    assert core.points["attn_proj"].offloaded_bytes == 16 * MIB  # now held only by the projection
    assert core.points["qkv_linear"].offloaded_bytes == 32 * MIB
    moe = acts(MOE, ("moe",), True)
    assert moe.points["expert_fc1"].offloaded_bytes == moe.points["moe_act"].offloaded_bytes == 0
    # moe_act's checkpoint keeps fc1's output (the act output is not stored), but the point is refused there
    act = acts(MOE, ("moe_act",), True)
    plain = layer_activations(MOE, ParallelLayout(), training(), moe=True)
    assert act.points["moe_act"].offloaded_bytes == 0 and "refused" in act.points["moe_act"].note
    assert plain.total_bytes - act.total_bytes == 32 * MIB
    local = training(transformer_impl="local", recompute_granularity="selective", recompute_modules=("layernorm",))
    norms = layer_activations(DENSE, ParallelLayout(), local, moe=False)
    # the norms' checkpoints keep their inputs (refused points); their outputs (qkv's input) are discarded
    assert norms.points["attn_norm"].offloaded_bytes == norms.points["mlp_norm"].offloaded_bytes == 0
    assert "refused" in norms.points["mlp_norm"].note and norms.points["qkv_linear"].offloaded_bytes == 0
    full = layer_activations(DENSE, ParallelLayout(), training(recompute_granularity="full"), moe=False,
                             checkpoint="input")
    assert all(p.offloaded_bytes == 0 for p in full.points.values())
    assert full.total_bytes == 16 * MIB
    assert full.recomputed_bytes == layer_activations(DENSE, ParallelLayout(), training(), moe=False).total_bytes


def test_block_recompute_checkpoints_the_first_layers_of_each_chunk():
    """megatron-core's block method checkpoints the first recompute_num_layers layers of every model chunk:
    they keep only their input (16 MiB here) and move nothing; the rest offload as without recompute (the
    chunk's first offloading layer is not its first layer, so qkv_linear moves its whole 32 MiB there)."""
    plain = plan_for(DENSE)
    block = plan_for(DENSE, recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert list(block.layers) == ["dense", "dense rc"]
    full_layer = block.layers["dense"].total_bytes
    assert block.layers["dense rc"].total_bytes == 16 * MIB
    assert block.layers["dense rc"].recomputed_bytes == full_layer
    # PP = 1: layers 2..14 of each of the 2 microbatches move; the last one turns around on the device
    per_step = block.offloaded_per_step(("qkv_linear", "core_attn"))[0]
    assert per_step == {"qkv_linear": 2 * 13 * 32 * MIB, "core_attn": 2 * 13 * 48 * MIB}
    assert moved(block, ("core_attn",)) == [13 * 48.0]
    assert plain.timelines[0].baseline_bytes - block.timelines[0].baseline_bytes == 2 * (full_layer - 16 * MIB)
    assert any("block of 2" in w for w in block.warnings)
    # interleaved: every chunk checkpoints its own first two layers
    layout = ParallelLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    pp = plan_for(DENSE, layout, num_microbatches=8, recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=2)
    assert [len(c.layers) for r in pp.ranks for c in r.chunks] == [4] * 4
    assert all(c.kinds == {"dense rc": 2, "dense": 2} for r in pp.ranks for c in r.chunks)


def test_uniform_recompute_keeps_one_input_a_unit_and_recomputes_the_unit_in_backward():
    """uniform with 4 layers a unit: 4 checkpoints keep their inputs, the 12 layers inside them nothing; the
    backward of the last unit first recomputes its 4 layers (3 whole layers plus the working set of the 4th)."""
    plan = plan_for(DENSE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=4)
    assert list(plan.layers) == ["dense rc", "dense rc+"]
    assert plan.layers["dense rc+"].total_bytes == 0
    full_layer = plan.layers["dense rc"].recomputed_bytes
    timeline = plan.timelines[0]
    start = [i for i in timeline.instants if i.kind == "backward start"]
    assert [i.base_bytes for i in start] == [4 * 16 * MIB + int(4.25 * full_layer)]
    assert timeline.offloaded_per_step(("core_attn",)) == {"core_attn": 0}
    assert any("checkpoints every layer" in w for w in plan.warnings)
    args = build_parser().parse_args(["plan", "--preset", "llama3-8b", "--recompute-granularity", "full",
                                      "--recompute-method", "uniform", "--recompute-num-layers", "4"])
    training_spec = config_from_args(args)[0].training
    assert (training_spec.recompute_method, training_spec.recompute_num_layers) == ("uniform", 4)


def test_recompute_is_flagged_in_the_output(capsys):
    rc = main(["plan", "--preset", "llama3-8b", "--recompute-granularity", "selective", "--offload-modules",
               "qkv_linear", "attn_proj"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "core_attn is recomputed" in out


@pytest.mark.parametrize(("recompute", "point"), [("core_attn", "core_attn"), ("layernorm", "mlp_norm"),
                                                   ("moe_act", "moe_act")])
def test_plan_refuses_what_a_run_would_refuse_under_recompute(capsys, recompute, point):
    rc = main(["plan", "--preset", "mixtral-8x7b", "--recompute-granularity", "selective", "--recompute-modules",
               recompute, "--offload-modules", point])
    assert rc == 2
    assert f"offload_modules has '{point}', but selective recompute of '{recompute}'" in capsys.readouterr().err


@pytest.mark.parametrize(("model", "recompute"), [(DENSE, ("core_attn",)), (MOE, ("core_attn",)),
                                                  (MOE, ("moe_act",)), (MOE, ("layernorm", "core_attn"))],
                         ids=["dense-core_attn", "moe-core_attn", "moe-moe_act", "moe-layernorm+core_attn"])
def test_every_set_the_plan_shows_under_recompute_is_one_a_run_accepts(model, recompute):
    """Under core_attn recompute attn_proj frees its bytes alone, so neither the sets shown nor the recommendation
    pair it with core_attn, which a run refuses there (until session 66 the plan recommended `qkv_linear core_attn
    attn_proj` under core_attn recompute, and showed that set as "attention")."""
    kw = dict(recompute_granularity="selective", recompute_modules=recompute)
    plan = plan_for(model, **kw)
    shown = [s.modules for s in plan.sets if s.modules] + [plan.recommendation.modules]
    assert plan.recommendation.modules
    for modules in shown:
        plan_for(model, **kw, offload_modules=tuple(modules))  # raises PlanError on a set a run would refuse
    if "core_attn" in recompute:
        assert all("core_attn" not in m for m in shown) and ("attn_proj",) in shown

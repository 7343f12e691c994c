"""pretrain_gpt.py's ways of setting offloaded steps against plain ones in one process (alternating steps, an
offloading window, switched runtime settings, a known host delay, a DMA load), end to end on the tiny CPU model:
each keeps the loss and reports what its JSON promises. Moved out of test_benchmarks.py, whose helpers they use."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from test_benchmarks import issue5_summary, tiny_base_and_ours, tiny_pair, tiny_run  # noqa: E402


@pytest.mark.multiproc
def test_pretrain_gpt_alternate_offload_pauses_every_odd_step_and_keeps_the_loss(tmp_path):
    base, ours = tiny_base_and_ours(tmp_path, 29633, ["--train-iters", "5", "--warmup-steps", "1"],
                                    ["core_attn", "--alternate-offload"])
    assert ours["loss_hex"] == base["loss_hex"]
    alt = ours["alternation"]
    assert alt["on_steps"] == [True, False, True, False, True]
    # the host's issue time: one per step, never longer than the step, split into offloaded / plain medians
    assert len(ours["issue_ms"]) == 5 and all(0 < i <= t for i, t in zip(ours["issue_ms"], ours["step_ms"]))
    assert alt["issue_ms_on_median"] > 0 and alt["issue_ms_off_median"] > 0
    assert ours["offload"]["steps"] == 3  # only the offloading steps left a record
    assert alt["pairs"] == 1 and "paired_overhead_pct" in alt  # step 2 (step 4 has no right neighbour)
    # one offloaded step in three: steps 0, 3 and 6 offload, the loss is still the baseline's (8 steps: the first
    # 5 are the baseline's, the runs are deterministic)
    third = tiny_run(tmp_path / "p3.json", 29633, ["--train-iters", "8", "--warmup-steps", "1",
                                                   "--fine-grained-activation-offloading", "--offload-modules",
                                                   "core_attn", "--alternate-offload", "--alternate-period", "3"])
    assert third["loss_hex"][:5] == base["loss_hex"]
    assert third["alternation"]["on_steps"] == [True, False, False, True, False, False, True, False]
    assert third["offload"]["steps"] == 3
    assert third["alternation"]["pairs"] == 1  # steps 3 and 6, of opposite parity, make one value
    # --offload-paused: the runtime in place and idle in every step: the baseline's losses, no step offloads
    idle = tiny_run(tmp_path / "idle.json", 29633, ["--train-iters", "5", "--warmup-steps", "1",
                                                    "--fine-grained-activation-offloading", "--offload-modules",
                                                    "core_attn", "--offload-paused", "--touch-transport",
                                                    "--touch-transport-step", "2"])
    assert idle["loss_hex"] == base["loss_hex"]
    # the probe's bookkeeping only: on the CPU there is no CUDA transport to make (benchmarks/state_probes.py)
    assert idle["state_probes"] == {"spare_streams": 0, "pin_host_gib": 0.0, "touch_transport": True,
                                    "touch_transport_step": 2}
    assert idle["offload"]["steps"] == 0 and ours["offload"]["steps"] == 3
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--alternate-offload"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--alternate-offload compares offloaded with plain steps" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--alternate-period", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--alternate-period sets how steps alternate" in proc.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--offload-paused"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--offload-paused keeps our runtime idle" in proc.stderr


@pytest.mark.multiproc
@pytest.mark.parametrize("release", ["keep", "both"])
def test_pretrain_gpt_offload_first_steps_then_plain_keeps_the_loss(tmp_path, release):
    """--offload-first-steps K: ours offloads in steps 0..K-1 only (releasing what --at-offload-stop names before step
    K), then idles: the baseline's losses, K offloaded steps on record, the plain steps' median from K+2 on."""
    base, ours = tiny_base_and_ours(tmp_path, 29641, ["--train-iters", "6", "--warmup-steps", "1"],
                                    ["core_attn", "--offload-first-steps", "2", "--at-offload-stop", release])
    assert ours["loss_hex"] == base["loss_hex"]
    assert ours["offload"]["steps"] == 2
    stop = ours["offload_stop"]
    assert stop["first_plain_step"] == 2 and stop["released"] == release and stop["plain_steps_counted"] == 2
    assert stop["plain_ms_median"] == statistics.median(ours["step_ms"][4:])
    assert stop["first_offloaded_step"] == 0 and stop["plain_before_steps_counted"] == 0
    assert stop["after_over_before_pct"] is None
    for flags, says in ((["--offload-first-steps", "2"], "--offload-first-steps offloads in the first K steps only"),
                        (["--offload-from-step", "2"], "--offload-from-step S starts the offloaded steps S..K-1"),
                        (["--touch-transport"], "--touch-transport makes our transport without offloading"),
                        (["--touch-transport-step", "3"], "--touch-transport-step S says when"),
                        (["--at-offload-stop", "both"], "--at-offload-stop says what to release")):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), *flags],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and says in proc.stderr


@pytest.mark.multiproc
def test_pretrain_gpt_offload_window_times_plain_steps_before_and_after(tmp_path):
    """--offload-from-step S --offload-first-steps K: steps S..K-1 offload, those before and after are plain, the
    losses are the baseline's, and issue5_host.sh's summary reports after over before."""
    base, ours = tiny_base_and_ours(tmp_path, 29643, ["--train-iters", "9", "--warmup-steps", "1"],
                                    ["core_attn", "--offload-from-step", "3", "--offload-first-steps", "6",
                                     "--spare-streams", "2", "--pin-host-gib", "0.5"])  # nothing taken on a CPU
    assert ours["loss_hex"] == base["loss_hex"]
    assert ours["state_probes"] == {"spare_streams": 2, "pin_host_gib": 0.5, "touch_transport": False,
                                    "touch_transport_step": 0}
    assert base["state_probes"] == {"spare_streams": 0, "pin_host_gib": 0.0, "touch_transport": False,
                                    "touch_transport_step": 0}
    assert ours["offload"]["steps"] == 3
    stop = ours["offload_stop"]
    # plain steps 1-2 before, offloaded step 5 counted (3-4 are the window's warm-up), plain step 8 after
    assert (stop["plain_before_steps_counted"], stop["offloaded_steps_counted"], stop["plain_steps_counted"]) == (
        2, 1, 1)
    before, offloaded, after = statistics.median(ours["step_ms"][1:3]), ours["step_ms"][5], ours["step_ms"][8]
    assert stop["after_over_before_pct"] == pytest.approx(100 * (after / before - 1))
    assert stop["offloaded_over_before_pct"] == pytest.approx(100 * (offloaded / before - 1))
    printed = issue5_summary(tmp_path, "mid_core_attn-none-1", ours)
    assert "offloaded steps 3..5 (released after: keep)" in printed and "after over before" in printed


@pytest.mark.multiproc
def test_pretrain_gpt_alternate_runtime_switches_our_settings_between_offloaded_steps(tmp_path):
    """--alternate-runtime: every step offloads, the even ones with the given settings, the odd ones with the
    runtime's own; the loss is the baseline's and each step held what it was given."""
    base, ours = tiny_base_and_ours(tmp_path, 29639, ["--train-iters", "5", "--warmup-steps", "1"],
                                    ["core_attn", "--alternate-runtime", "flush_layers=1", "reload_layers=2",
                                     "prefetch=late"])
    assert ours["loss_hex"] == base["loss_hex"]
    assert ours["alternation"]["on_steps"] == [True, False, True, False, True]
    assert ours["offload"]["steps"] == 5  # every step offloaded
    switched = ours["alternate_runtime"]
    assert switched["settings"] == {"flush_layers": 1, "reload_layers": 2, "prefetch": "late"}
    assert switched["defaults"] == {"flush_layers": 2, "reload_layers": 1, "prefetch": "tail"}
    assert switched["held_per_step"] == [switched["settings"], switched["defaults"]] * 2 + [switched["settings"]]
    assert switched["medians"]["runtime_cpu_ms"]["test"] > 0 and switched["medians"]["runtime_cpu_ms"]["default"] > 0
    # issue5_host.sh's summary (its Python, run here on this run's JSON) names the settings and both host times
    printed = issue5_summary(tmp_path, "sw_core_attn-none-1", ours)
    assert ("settings {'flush_layers': 1, 'reload_layers': 2, 'prefetch': 'late'} against {'flush_layers': 2, "
            "'reload_layers': 1, 'prefetch': 'tail'}") in printed


@pytest.mark.parametrize("flags, says", [
    (["--alternate-runtime", "flush_layers=4"], "add --fine-grained-activation-offloading"),
    (["--fine-grained-activation-offloading", "--alternate-runtime", "chain_points=0"], "KEY one of flush_layers"),
    (["--fine-grained-activation-offloading", "--alternate-runtime", "flush_layers=0"], "positive whole number"),
    (["--fine-grained-activation-offloading", "--alternate-runtime", "prefetch=early"], "one of layer, tail, late"),
    (["--fine-grained-activation-offloading", "--alternate-runtime", "flush_layers=2", "flush_layers=4"], "twice"),
    (["--fine-grained-activation-offloading", "--alternate-offload", "--alternate-runtime", "flush_layers=4"],
     "use one of them per run"),
])
def test_pretrain_gpt_alternate_runtime_refuses_bad_settings(flags, says):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), *flags],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]


@pytest.mark.multiproc
def test_pretrain_gpt_host_delay_spins_every_layer_of_every_other_step_and_keeps_the_loss(tmp_path):
    """--host-delay-us: every layer's forward and backward of the delayed steps spin once; numbers unchanged."""
    plain, delayed = tiny_pair(tmp_path, 29637, ["--train-iters", "5", "--warmup-steps", "1"], [],
                               ["--host-delay-us", "200", "300"])
    assert delayed["loss_hex"] == plain["loss_hex"]
    assert delayed["alternation"]["on_steps"] == [True, False, True, False, True]
    hd = delayed["host_delay"]
    # the tiny model: 4 layers x 2 microbatches, one spin each way per layer and microbatch of a delayed step
    assert hd["fwd_calls_per_delayed_step"] == hd["bwd_calls_per_delayed_step"] == 8
    assert hd["delay_ms_per_delayed_step"] == pytest.approx(8 * 0.5)
    assert "host_delay" not in plain
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--alternate-offload",
                           "--host-delay-us", "1", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "use one of them per run" in proc.stderr


def test_pretrain_gpt_dma_load_every_layer_needs_dma_load():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--dma-load-every-layer"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "give --dma-load-mib FWD BWD too" in proc.stderr


@pytest.mark.parametrize("extra, says", [
    (["--host-delay-us", "1", "1"], "use one of them per run"),
    (["--fine-grained-activation-offloading"], "drop --fine-grained-activation-offloading"),
])
def test_pretrain_gpt_dma_load_refuses_other_alternations_and_offloading(extra, says):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--dma-load-mib", "1", "1",
                           *extra], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and says in proc.stderr


@pytest.mark.multiproc
def test_pretrain_gpt_without_pack_hooks_runs_the_points_and_moves_nothing(tmp_path):
    """--without-pack-hooks: the points run without their saved-tensor hooks, so nothing is packed or moved and the
    loss is the baseline's; the row says so. Without offloading it is an error."""
    base, ours = tiny_base_and_ours(tmp_path, 29651, ["--train-iters", "3", "--warmup-steps", "1"],
                                    ["core_attn", "--without-pack-hooks"])
    assert ours["loss_hex"] == base["loss_hex"]
    assert ours["without_pack_hooks"] is True and base["without_pack_hooks"] is False
    assert ours["node_hooks"] is True and "node_hooks" not in base
    # with its hooks, core_attn offloads in every step of this run (the alternation tests above): here no step did
    assert ours["offload"]["steps"] == 0 and ours["offload"]["host_buffer_allocations"] == 0
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--without-pack-hooks"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--without-pack-hooks runs our offload points" in proc.stderr


@pytest.mark.multiproc
def test_pretrain_gpt_without_node_hooks_keeps_the_loss_and_needs_nothing_to_move(tmp_path):
    """--without-node-hooks (with nothing large enough to move): the baseline's loss, nothing offloaded; with tensors
    that would move it is an error, since no group would be reloaded."""
    big = ["--min-offloaded-tensor-size", "1000000000000"]
    base, ours = tiny_base_and_ours(tmp_path, 29655, ["--train-iters", "3", "--warmup-steps", "1"],
                                    ["core_attn", "--without-node-hooks", "--without-pack-hooks", *big])
    assert ours["loss_hex"] == base["loss_hex"]
    assert ours["without_node_hooks"] is True and ours["offload"]["steps"] == 0
    assert ours["node_hooks"] is False  # the switch reached the manager (it is read when the manager is made)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--without-node-hooks",
                           "--fine-grained-activation-offloading", "--offload-modules", "core_attn"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--without-node-hooks leaves offloaded groups without their reloads" in proc.stderr


def test_without_node_hooks_sends_the_points_to_plain_identities(monkeypatch):
    """What --without-node-hooks changes: the runtime's own switch (MCORE_OFFLOAD_NODE_HOOKS=0, read when the
    manager is made) and identity nodes that are plain identities; the commit still queues its group."""
    import point_switches

    from mcore_offload.runtime import points

    monkeypatch.setattr(points, "_start", points._start)
    monkeypatch.setattr(points, "_commit_node", points._commit_node)
    monkeypatch.setenv("MCORE_OFFLOAD_NODE_HOOKS", "1")
    point_switches.without_node_hooks()
    assert os.environ["MCORE_OFFLOAD_NODE_HOOKS"] == "0"
    queued = []

    class Handler:
        def on_group_commit_forward(self, group):
            queued.append(group)

    t = object()
    assert points._start(t, Handler(), "g") is t
    assert points._commit_node(t, Handler(), "g") is t and queued == ["g"]


@pytest.mark.multiproc
def test_pretrain_gpt_core_attn_eviction_runs_in_every_step_and_keeps_the_loss(tmp_path):
    common = ["--train-iters", "4", "--warmup-steps", "1"]
    base, ours = tiny_base_and_ours(tmp_path, 29641, common, ["core_attn", "--alternate-offload",
                                                              "--evict-core-attn-mib", "1"])
    assert ours["loss_hex"] == base["loss_hex"]
    ev = ours["cache_evict"]
    # the tiny model: 4 layers x 2 microbatches, two moments each way a layer-microbatch, offloaded and plain steps
    assert ev["attention_modules"] == 4 and ev["fwd_calls_per_step"] == 16 and ev["bwd_calls_per_step"] == 16
    assert ev["mib"] == 1.0 and ev["spin_us"] == 0 and ev["evict_us_mean"] > 0
    spin = tiny_run(tmp_path / "spin.json", 29641, [*common, "--core-attn-spin-us", "50"])
    assert spin["loss_hex"] == base["loss_hex"]
    assert spin["cache_evict"]["spin_us"] == 50 and spin["cache_evict"]["evict_us_mean"] >= 50
    assert spin["cache_evict"]["bwd_calls_per_step"] == 16
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--evict-core-attn-mib", "1",
                           "--core-attn-spin-us", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "two kinds of the same probe" in proc.stderr


def test_pretrain_gpt_no_moe_grouped_gemm_builds_sequential_te_experts_and_needs_experts(monkeypatch):
    """--no-moe-grouped-gemm: the TE spec's experts become a SequentialMLP (Megatron-LM's default without
    --moe-grouped-gemm), in the config and in the layer spec; without --num-experts it is refused in one sentence."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from pretrain_args import parse_args
    from pretrain_model import build_config

    args = parse_args(["--num-experts", "4", "--no-moe-grouped-gemm"])
    assert build_config(args).moe_grouped_gemm is False
    assert build_config(parse_args(["--num-experts", "4"])).moe_grouped_gemm is True  # the script's TE default
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pretrain_gpt.py"), "--no-moe-grouped-gemm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "add --num-experts N" in proc.stderr
    # the spec build_model asks for (TE is not installed here, so only its arguments are checked)
    from pretrain_model import build_model

    class Asked(Exception):
        pass

    def spec(**kw):
        raise Asked(kw)

    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", spec)
    with pytest.raises(Asked) as asked:
        build_model(args, None)
    assert asked.value.args[0] == {"num_experts": 4, "moe_grouped_gemm": False}

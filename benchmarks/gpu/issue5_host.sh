#!/usr/bin/env bash
# Where the host time of a launch-bound step goes (issue 5). GPU host, project root, 0.15.3 patched:
#   [COSTS=0] [BINDS="none gpu-local compact"] [VARIANTS="baseline core_attn hooks_only"] [REPS=2] [ITERS=30] [NPROC=1] \
#   [LAYERS=4 | CONFIG=A|B|C] [OLD_TREE=DIR] [RUN_TIMEOUT=150] \
#     bash benchmarks/gpu/issue5_host.sh OUTDIR
# 1. per-call host cost of each CUDA / autograd primitive on the hot path (benchmarks/gpu/host_costs.py);
# 2. config A cut to 4 layers (LAYERS), interleaved repetitions of: baseline; ours core_attn; ours core_attn with
#    min_offloaded_tensor_size above every tensor (points, groups and hooks run, nothing moves); under each
#    --cpu-bind mode (benchmarks/cpu_affinity.py). Variants "breakdown" / "hooks_breakdown": core_attn / hooks_only
#    with --runtime-breakdown (host time per runtime function, benchmarks/runtime_breakdown.py;
#    "experts_breakdown": the MoE experts set, CONFIG=C); NAME@old runs
#    NAME with the mcore_offload package found in OLD_TREE (before/after comparisons in one interleaved run);
#    "attn" and "auto": the attention set and offload_modules=["auto"]. alt_NAME: NAME with --alternate-offload
#    (offloaded and plain steps alternate in one process: the paired overhead, immune to the host's drift;
#    ALT_PERIOD=3: one offloaded step in three, on even and odd steps in turn, and the plain steps' parity effect);
#    sw_NAME: NAME offloaded in every step, the alternation's steps with the runtime settings SWITCH (default
#    "flush_layers=4 reload_layers=2") and the others with the defaults (--alternate-runtime: the settings' cost);
#    idle_NAME: NAME's flags with every step inside mcore_offload.paused() (--offload-paused: the patches and the
#    runtime in place, nothing offloaded), to time against "baseline" in the same run;
#    stop_NAME / stopec_NAME / stoph_NAME / stopb_NAME: NAME offloaded in steps 0..STOP_AT-1 (default 12) only, then
#    paused, releasing nothing / the device cache / the host buffers / both first (benchmarks/offload_stop.py);
#    NAME_ssa / NAME_ssh: MCORE_OFFLOAD_SIDE_STREAMS=aligned / high-priority (runtime/side_streams.py); state probes
#    (benchmarks/state_probes.py) as prefixes: spareN_NAME takes N pooled streams that nothing uses, pinN_NAME holds
#    N GiB of pinned host memory, tt_idle_NAME makes our transport with nothing offloaded (ttS_idle_NAME: before step
#    S, after NCCL's pipeline communicator exists); NAME_nccldbg: NCCL_DEBUG=INFO (INIT, P2P) in the run's log;
#    mid_NAME: NAME offloaded in steps MID_FROM..MID_TO-1 only (default 20..29), plain before and after: in one
#    process, do plain steps after offloading run slower than before it? and the offloaded steps' overhead over the
#    plain ones before (mid_NAME@native: native's, and the summary's ratio of the two, overhead_ratio.py).
#    midec_NAME / midh_NAME / midb_NAME: mid_NAME releasing the device cache / the host buffers / both before the
#    plain steps after the window (benchmarks/step_floor.py reads before and after by their fastest steps);
#    NAME_bd: NAME with --runtime-breakdown (suffix order NAME_torchcopy_nochain_bd);
#    NAME_torchcopy: PyTorch's copy_ instead of the raw cudaMemcpyAsync (MCORE_OFFLOAD_RAW_COPY=0); NAME_nochain: one
#    group per point (MCORE_OFFLOAD_CHAIN_POINTS=0; suffix order NAME_torchcopy_nochain); "experts" and
#    "all5": the MoE sets (CONFIG=C). SYNCS=1 adds --time-syncs (host time blocked in .cpu/.item/.tolist and
#    Event/Stream.synchronize per step, benchmarks/sync_wait.py). "delayfwd" / "delaybwd": no offloading; every
#    other step spins DELAY_US (default 500) µs of host time at each layer's forward / backward
#    (benchmarks/host_delay.py): the share of host time the step exposes there. NPROC=2 with CONFIG=D-dense or
#    D-moe: the pipeline-parallel configurations, one rank per GPU (the summary prints rank 0's row; the JSON
#    has every rank's). "dmaload": no offloading; every other step copies DMA_MIB (default 48, A core_attn's bytes
#    per layer and microbatch) out at each layer's forward and in at its backward (benchmarks/dma_load.py): what
#    the link traffic alone costs; each chunk's last layer left out. "dmaload_all": the same at every layer (ours
#    offloads every layer of most chunks under pipelining: D-dense's rank 0 moves 48 MiB at all 64
#    layer-microbatches of a step with core_attn). NAME_wc: host buffers in write-combined memory
#    (MCORE_OFFLOAD_HOST_MEMORY).
#    blkB_NAME: NAME alternating blocks of B steps (--alternate-block B: B plain, B offloaded, ...; each offloaded
#    block's median over its plain neighbours', the first step of every block left out; blkB_NAME@native too).
#    NAME_nolook: MCORE_OFFLOAD_SECOND_LOOK=0 (runtime/second_look.py off). NAME_nosplit:
#    MCORE_OFFLOAD_SPLIT_CHAINS=0 (a chain reloads as one part, prefetch.Prefetch._chain_parts). NAME_oc0 (auto):
#    MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK=0 (a group priced at the runtime's clock alone, the model before session 67);
#    NAME_bx (auto): MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE=1 (exposure: the mean of the forward's and the backward's).
#    NAME_hbN (auto): MCORE_OFFLOAD_AUTO_HOST_BUDGET=0.N (N per mille of the plain step, three digits: _hb030 is 3 %).
#    "autotarget": offload_modules=["auto:$AUTO_GIB"] (a per-rank peak target in GiB; AUTO_GIB must be set).
#    NAME_fN / NAME_r2: MCORE_OFFLOAD_FLUSH_LAYERS=N / MCORE_OFFLOAD_RELOAD_LAYERS=2. NAME_iflN:
#    MCORE_OFFLOAD_D2H_IN_FLIGHT=N (at most N copy-out bursts in flight). NAME_few: MCORE_OFFLOAD_FORWARD_END=wait. NAME_coal:
#    MCORE_OFFLOAD_COALESCE_RELOADS=1 (one reload copy per group). NAME_py: the Python
#    saved-tensor hooks (MCORE_OFFLOAD_NATIVE=0; every other run sets MCORE_OFFLOAD_NATIVE=${NATIVE:-1}: C++ or fail). NAME@native: NAME on upstream's
#    megatron-core 0.16.1 (NATIVE_TREE), its native offloading; alt_NAME@native alternates it too. "all5_hooks": the
#    five MoE points with nothing large enough to move (hooks_only for CONFIG=C); "experts_hooks" the same for
#    expert_fc1 moe_act (C experts' points alone, session 65); "attn_hooks" the same for the
#    attention set; "attn_nopack" that again without the saved-tensor hooks (--without-pack-hooks: what their
#    dispatch costs), "attn_nonode" without the node hooks (--without-node-hooks), "attn_bare" without both. EXTRA: more pretrain_gpt.py flags
#    for every run (EXTRA=--peak-trace: what was live at step 1's peak, benchmarks/peak_trace.py).
# The summary's "loss equal" compares each run's last rank (the pipeline's last stage) with the baseline's; its
# "slow / fast third" line sets the run's slowest third of steps against its fastest by each host counter
# (pretrain_gpt.py's host_clock, benchmarks/host_periods.py: slow, fast, rank correlation with the step time).
# The summary ends with, for every alt_ variant that also ran as NAME@native, the ratio of the two paired overheads
# per rank with its 95 % interval and issue 5's verdict (benchmarks/overhead_ratio.py). "STOPPED ... (complete)": the
# run hit RUN_TIMEOUT after rank 0 had written its JSON (torchrun's teardown), so its results stand.
set -u
out=${1:?outdir}; mkdir -p "$out"
{ nvidia-smi topo -m; lscpu | head -25; cat /proc/loadavg; } > "$out/host_topology.txt" 2>&1
[ "${COSTS:-1}" = 1 ] && python3 benchmarks/gpu/host_costs.py --out "$out/host_costs.json" 2>&1 | tail -30
A="--num-layers ${LAYERS:-4} --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096
   --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --deterministic --num-microbatches 4
   --train-iters ${ITERS:-30} --warmup-steps 5"
if [ -n "${CONFIG:-}" ]; then  # a configuration of the benchmark matrix (benchmarks/peak_memory.py) instead of A cut
  model=$(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import peak_memory as p; c = p.CONFIGS['$CONFIG']
print(c.model, c.extra)") || exit 1
  A="$model --train-iters ${ITERS:-30} --warmup-steps 5"
fi
OFF="--fine-grained-activation-offloading --offload-modules core_attn"
i=0
for rep in $(seq 1 "${REPS:-2}"); do
  for bind in ${BINDS:-none}; do
    for name in ${VARIANTS:-baseline core_attn hooks_only}; do
      # NAME@old: the same variant with the runtime of another checkout (OLD_TREE, a folder that holds an older
      # mcore_offload package) first on PYTHONPATH; the patched megatron-core tree is the same.
      # NAME@native: the same variant on upstream's megatron-core 0.16.1 (NATIVE_TREE, default /root/mc-0.16.1, first
      # on PYTHONPATH): its native offloading, with alt_ alternating through benchmarks/native_pause.py.
      tree=""; case $name in *@old) tree=${OLD_TREE:?OLD_TREE must name a folder holding an older mcore_offload};;
        *@native) tree=${NATIVE_TREE:-/root/mc-0.16.1};; esac
      raw=1; chain=1
      name0=$name; name=${name%@native}
      case ${name%@old} in *_torchcopy*) raw=0 ;; esac
      case ${name%@old} in *_nochain*) chain=0 ;; esac
      hostmem=pinned; case ${name%@old} in *_wc*) hostmem=write-combined ;; esac
      envs="MCORE_OFFLOAD_RAW_COPY=$raw MCORE_OFFLOAD_CHAIN_POINTS=$chain MCORE_OFFLOAD_HOST_MEMORY=$hostmem"
      # _fN: N layers a copy-out burst (MCORE_OFFLOAD_FLUSH_LAYERS; _f4 since session 40, any N since session 85;
      # _few, which has no digit, is not one)
      [[ ${name%@old} =~ _f([0-9]+) ]] && envs="$envs MCORE_OFFLOAD_FLUSH_LAYERS=${BASH_REMATCH[1]}"
      case ${name%@old} in *_r2*) envs="$envs MCORE_OFFLOAD_RELOAD_LAYERS=2" ;; esac
      case ${name%@old} in *_coal*) envs="$envs MCORE_OFFLOAD_COALESCE_RELOADS=1" ;; esac
      case ${name%@old} in *_nolook*) envs="$envs MCORE_OFFLOAD_SECOND_LOOK=0" ;; esac
      case ${name%@old} in *_nosplit*) envs="$envs MCORE_OFFLOAD_SPLIT_CHAINS=0" ;; esac
      case ${name%@old} in *_oc0*) envs="$envs MCORE_OFFLOAD_AUTO_OUTSIDE_CLOCK=0" ;; esac
      case ${name%@old} in *_bx*) envs="$envs MCORE_OFFLOAD_AUTO_BACKWARD_EXPOSURE=1" ;; esac
      # _few: a chunk's forward end waits for the copy-out still running (MCORE_OFFLOAD_FORWARD_END=wait; session 84)
      case ${name%@old} in *_few*) envs="$envs MCORE_OFFLOAD_FORWARD_END=wait" ;; esac
      # _iflN: at most N copy-out bursts in flight (MCORE_OFFLOAD_D2H_IN_FLIGHT; session 58)
      [[ ${name%@old} =~ _ifl([0-9]+) ]] && envs="$envs MCORE_OFFLOAD_D2H_IN_FLIGHT=${BASH_REMATCH[1]}"
      # _hbN (auto): the host-time budget at N per mille of the plain step (MCORE_OFFLOAD_AUTO_HOST_BUDGET; session 71)
      [[ ${name%@old} =~ _hb([0-9]+) ]] && envs="$envs MCORE_OFFLOAD_AUTO_HOST_BUDGET=$(printf '0.%03d' "$((10#${BASH_REMATCH[1]}))")"
      case ${name%@old} in *_nccldbg*) envs="$envs NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P" ;; esac
      case ${name%@old} in *_ssa*) envs="$envs MCORE_OFFLOAD_SIDE_STREAMS=aligned" ;;
        *_ssh*) envs="$envs MCORE_OFFLOAD_SIDE_STREAMS=high-priority" ;; esac
      # state probes (benchmarks/state_probes.py), prefixes in any order before the variant's own name
      spare=""; nosp=$name
      while :; do case $nosp in
          spare[0-9]*_*) n=${nosp%%_*}; spare="$spare --spare-streams ${n#spare}"; nosp=${nosp#*_} ;;
          pin[0-9]*_*) n=${nosp%%_*}; spare="$spare --pin-host-gib ${n#pin}"; nosp=${nosp#*_} ;;
          tt_*) spare="$spare --touch-transport"; nosp=${nosp#tt_} ;;
          tt[0-9]*_*) n=${nosp%%_*}; spare="$spare --touch-transport --touch-transport-step ${n#tt}"; nosp=${nosp#*_} ;;
          *) break ;; esac; done
      case ${name%@old} in *_py*) envs="$envs MCORE_OFFLOAD_NATIVE=0" ;; *) envs="$envs MCORE_OFFLOAD_NATIVE=${NATIVE:-1}" ;; esac
      case ${nosp%@old} in alt_*) alt="--alternate-offload --alternate-period ${ALT_PERIOD:-2}" ;;
        blk[0-9]*_*) n=${nosp%%_*}; alt="--alternate-offload --alternate-block ${n#blk}" ;;
        idle_*) alt="--offload-paused" ;;
        stop_*) alt="--offload-first-steps ${STOP_AT:-12}" ;;
        stopec_*) alt="--offload-first-steps ${STOP_AT:-12} --at-offload-stop empty-cache" ;;
        stoph_*) alt="--offload-first-steps ${STOP_AT:-12} --at-offload-stop release-host" ;;
        stopb_*) alt="--offload-first-steps ${STOP_AT:-12} --at-offload-stop both" ;;
        mid_*) alt="--offload-from-step ${MID_FROM:-20} --offload-first-steps ${MID_TO:-30}" ;;
        midec_*) alt="--offload-from-step ${MID_FROM:-20} --offload-first-steps ${MID_TO:-30} --at-offload-stop empty-cache" ;;
        midh_*) alt="--offload-from-step ${MID_FROM:-20} --offload-first-steps ${MID_TO:-30} --at-offload-stop release-host" ;;
        midb_*) alt="--offload-from-step ${MID_FROM:-20} --offload-first-steps ${MID_TO:-30} --at-offload-stop both" ;;
        # an odd telemetry period, so that GPU-timed steps fall on both sides of the switch (session 40: every
        # fourth step timed only the switched side)
        sw_*) alt="--alternate-runtime ${SWITCH:-flush_layers=4 reload_layers=2} --alternate-period ${ALT_PERIOD:-2}"
          envs="$envs MCORE_OFFLOAD_TELEMETRY_EVERY=${SW_TELEMETRY_EVERY:-3}" ;;
        *) alt="" ;; esac
      case ${name%@old} in *_bd) alt="$alt --runtime-breakdown" ;; esac
      base=${nosp%@old}; base=${base//_ssa/}; base=${base//_ssh/}; base=${base//_nccldbg/}; base=${base//_wc/}; base=${base//_coal/}; base=${base//_nolook/}; base=${base//_nosplit/}; base=${base//_oc0/}; base=${base//_bx/}; base=${base//_few/}; base=${base//_py/}; [[ $base =~ ^(.*)_f[0-9]+(.*)$ ]] && base=${BASH_REMATCH[1]}${BASH_REMATCH[2]}; base=${base//_r2/}; base=${base%%_ifl[0-9]*}; base=${base%%_hb[0-9]*}; base=${base#alt_}; base=${base#sw_}; base=${base#idle_}; base=${base#stop_}; base=${base#stopec_}; base=${base#stoph_}; base=${base#stopb_}; base=${base#mid_}; base=${base#midec_}; base=${base#midh_}; base=${base#midb_}; [[ $base =~ ^blk[0-9]+_(.*)$ ]] && base=${BASH_REMATCH[1]}; base=${base%_bd}; base=${base%_nochain}; base=${base%_torchcopy}
      case $base in baseline) flags="" ;; core_attn) flags=$OFF ;;
        hooks_only) flags="$OFF --min-offloaded-tensor-size 1000000000000" ;;
        attn) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj" ;;
        auto) flags="--fine-grained-activation-offloading --offload-modules auto" ;;
        autotarget) flags="--fine-grained-activation-offloading --offload-modules auto:${AUTO_GIB:?set AUTO_GIB, the per-rank peak target in GiB}" ;;
        experts) flags="--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act" ;;
        all5) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj expert_fc1 moe_act" ;;
        attn_hooks) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj --min-offloaded-tensor-size 1000000000000" ;;
        experts_hooks) flags="--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act --min-offloaded-tensor-size 1000000000000" ;;
        all5_hooks) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj expert_fc1 moe_act --min-offloaded-tensor-size 1000000000000" ;;
        attn_nopack) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj --min-offloaded-tensor-size 1000000000000 --without-pack-hooks" ;;
        attn_nonode) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj --min-offloaded-tensor-size 1000000000000 --without-node-hooks" ;;
        attn_bare) flags="--fine-grained-activation-offloading --offload-modules qkv_linear core_attn attn_proj --min-offloaded-tensor-size 1000000000000 --without-pack-hooks --without-node-hooks" ;;
        breakdown) flags="$OFF --runtime-breakdown" ;;
        experts_breakdown) flags="--fine-grained-activation-offloading --offload-modules expert_fc1 moe_act --runtime-breakdown" ;;
        delayfwd) flags="--host-delay-us ${DELAY_US:-500} 0 --alternate-period ${ALT_PERIOD:-2}" ;;
        dmaload) flags="--dma-load-mib ${DMA_MIB:-48} ${DMA_MIB:-48} --alternate-period ${ALT_PERIOD:-2}" ;;
        dmaload_all) flags="--dma-load-mib ${DMA_MIB:-48} ${DMA_MIB:-48} --dma-load-every-layer --alternate-period ${ALT_PERIOD:-2}" ;;
        delaybwd) flags="--host-delay-us 0 ${DELAY_US:-500} --alternate-period ${ALT_PERIOD:-2}" ;;
        hooks_breakdown) flags="$OFF --min-offloaded-tensor-size 1000000000000 --runtime-breakdown" ;; esac
      name=$name0
      i=$((i + 1)); tag=${name/@old/_old}; tag=${tag/@native/_native}-$bind-$rep
      rm -f "$out/$tag.json"  # a JSON left from an earlier run must not pass for this one's
      # LAUNCH_PREFIX: a command put before torchrun, @TAG@ replaced by the run's tag (perf record, perf_steps.py)
      prefix=${LAUNCH_PREFIX:-}; prefix=${prefix//@TAG@/$tag}
      env $envs PYTHONPATH=${tree:+$tree:}$PYTHONPATH timeout ${RUN_TIMEOUT:-150} $prefix torchrun --nproc-per-node ${NPROC:-1} \
        --master-port $((29520 + i)) benchmarks/pretrain_gpt.py $A $flags $alt $spare ${SYNCS:+--time-syncs} ${EXTRA:-} \
        --cpu-bind "$bind" --json-out "$out/$tag.json" --label "$name" > "$out/$tag.log" 2>&1 || {
          # rank 0 writes the JSON after the last step: a run stopped after that (torchrun's teardown past
          # RUN_TIMEOUT) has complete results
          [ -s "$out/$tag.json" ] && echo "STOPPED after writing its results (complete): $tag" || echo "FAILED $tag"; }
    done
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics as st, sys
sys.path.insert(0, "benchmarks")
from host_periods import split_by_step_time  # noqa: E402
from overhead_ratio import compare, compare_windows, is_window_run  # noqa: E402
from step_floor import lower_percentile  # noqa: E402

files = sorted(pathlib.Path(sys.argv[1]).glob("*-*-[0-9].json"))
ranks = {f.stem: json.loads(f.read_text())["ranks"] for f in files}
runs = {stem: rows[0] for stem, rows in ranks.items()}
# the losses live on the last pipeline stage: under PP rank 0's are all None and would compare equal to anything
last = {stem: max(rows, key=lambda row: row["rank"])["loss_hex"] for stem, rows in ranks.items()}
for stem, r in runs.items():
    t = r["step_ms"][5:] or r["step_ms"]  # short runs (the CPU test) keep every step
    base = "baseline-" + stem.split("-", 1)[1]
    same = "-" if base not in runs or stem.startswith("baseline") else (
        "no losses" if all(x is None for x in last[stem]) else last[stem] == last[base])
    print(f"{stem:24s} median {st.median(t):7.1f}  q10 {lower_percentile(t, 0.1):7.1f}  min {min(t):7.1f} ms  loss equal {same}  "
          f"host {r.get('runtime_cpu_ms')}  issued {r.get('issue_ms_median')} ms  cpus {len(r.get('cpus') or [])}  "
          f"load {r.get('loadavg')}  "
          f"device mallocs/frees after step 1: {[sum(v[2:]) for v in (r.get('allocator_per_step') or {}).values()]}")
    if r.get("host_clock") and len(t) >= 6:  # the slowest third of the steps against the fastest (host_periods.py)
        hp = split_by_step_time(r, len(r["step_ms"]) - len(t))
        print("  slow / fast third: " + ", ".join(f"{k} {v['slow']}/{v['fast']} ({v['rank_corr']})" for k, v in hp.items()
                                                 if isinstance(v, dict) and "rank_corr" in v))
    stop = r.get("offload_stop")
    if stop:
        print(f"  offloaded steps {stop['first_offloaded_step']}..{stop['first_plain_step'] - 1} (released after: "
              f"{stop['released']}): plain steps from two after, median {stop['plain_ms_median']:.1f} ms over "
              f"{stop['plain_steps_counted']}; before, {stop['plain_before_ms_median']} ms over "
              f"{stop['plain_before_steps_counted']}: after over before {stop['after_over_before_pct']} %; offloaded "
              f"{stop.get('offloaded_ms_median')} ms over {stop.get('offloaded_steps_counted')}: over before "
              f"{stop.get('offloaded_over_before_pct')} % {stop.get('offloaded_over_before_ci95_pct')}")
    alt = r.get("alternation")
    if alt:
        # the worst offloaded step sets delta peak; the median one says whether most steps did better (session 83)
        on_peaks = [p for p, on in zip(alt.get("step_peaks") or [], alt.get("on_steps") or []) if on and p]
        off_max = alt.get("peak_bytes_off_max")
        median_delta = (off_max - st.median(on_peaks)) / 2**20 if on_peaks and off_max else None
        print(f"  alternating: {alt['pairs']} pairs, paired overhead {alt.get('paired_overhead_pct')} % "
              f"(95 % interval {alt.get('paired_overhead_ci95_pct')}), on/off medians {alt['step_ms_on_median']:.1f}"
              f"/{alt['step_ms_off_median']:.1f} ms, delta peak {(alt.get('delta_peak_bytes') or 0) / 2**20:.0f} MiB "
              f"(median offloaded step {median_delta if median_delta is None else round(median_delta)} MiB), "
              f"stall {r.get('stall_ms')} ms, trailing max {r.get('trailing_mib_max')} MiB, "
              f"d2h {r.get('d2h_GBps')} h2d {r.get('h2d_GBps')} GB/s, issued on/off "
              f"{alt.get('issue_ms_on_median')}/{alt.get('issue_ms_off_median')} ms")
        ps = alt.get("plain_steps")
        if ps:
            print(f"  plain steps ({ps['plain_twos']} twos): even over odd {ps['even_over_odd_pct']} % "
                  f"{ps['even_over_odd_ci95_pct']}, first after an offloaded step over the next "
                  f"{ps['after_offloaded_pct']} % {ps['after_offloaded_ci95_pct']}")
        sw = r.get("alternate_runtime")
        if sw:
            m = sw["medians"]
            print(f"  settings {sw['settings']} against {sw['defaults']}: the overhead above is theirs over the "
                  f"defaults; runtime host ms {m['runtime_cpu_ms']['test']} / {m['runtime_cpu_ms']['default']}, "
                  f"stall ms {m['stall_ms']['test']} / {m['stall_ms']['default']}")
        hd = r.get("host_delay")
        if hd and alt.get("paired_overhead_pct") is not None:
            added = alt["paired_overhead_pct"] / 100 * alt["step_ms_off_median"]
            print(f"  host delay {hd['delay_ms_per_delayed_step']:.1f} ms/step added -> {added:.1f} ms/step exposed "
                  f"({added / hd['delay_ms_per_delayed_step']:.2f}); calls {hd}")
        dl = r.get("dma_load")
        if dl:
            print(f"  dma load: {dl['d2h_bytes_per_loaded_step'] / 2**30:.2f} / {dl['h2d_bytes_per_loaded_step'] / 2**30:.2f}"
                  f" GiB per step out / in ({dl['host_memory']}), hooks {dl['hook_host_ms_per_loaded_step']:.1f} ms")
    sw = r.get("sync_wait")
    if sw:
        print(f"  sync reads: on/off medians {sw.get('on_median_ms')} / {sw.get('off_median_ms')} ms per step, "
              f"calls {sw['calls_per_step'][-1]}")
    bd = r.get("runtime_breakdown")
    if bd:
        print(f"  breakdown (inclusive, wrapper {bd['wrapper_us']} us/call):")
        for name, v in list(bd["functions"].items())[:24]:
            print(f"    {name:46s} {v['us_per_step']:9.1f} us/step {v['calls_per_step']:7.1f} calls {v['us_per_call']:8.2f} us/call")
# ours against native, per rank, wherever a variant ran both ways (benchmarks/overhead_ratio.py: issue 5's third)
for stem in runs:
    native = stem.replace("-", "_native-", 1)
    window = is_window_run(f"{sys.argv[1]}/{stem}.json")
    if "_native" not in stem and native in runs and (runs[stem].get("alternation") or window):
        try:
            rows = (compare_windows if window else compare)([f"{sys.argv[1]}/{stem}.json"],
                                                            [f"{sys.argv[1]}/{native}.json"], 1 / 3)
        except ValueError as e:
            print(f"  {stem} / native: no ratio ({e})")
            continue
        print(f"  {stem} / native, ratio of overheads [95 %] by rank: " + "; ".join(
            f"{r['rank']}: {r['ratio']} {r['ratio_ci95']} {r['verdict']}" for r in rows))
PY

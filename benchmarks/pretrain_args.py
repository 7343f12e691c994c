"""The command line of ``benchmarks/pretrain_gpt.py``: Megatron-LM-style model and parallelism flags, the offload
flags, and the measurement switches (alternation, host delay, DMA load, profiles), each checked against the others.
"""

from __future__ import annotations

import argparse

from mcore_offload.megatron_args import add_offload_args


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """``pretrain_gpt.py``'s flags (Megatron-LM's spelling), checked, with the derived defaults filled in."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--num-layers", type=int, default=2)
    a("--hidden-size", type=int, default=64)
    a("--num-attention-heads", type=int, default=4)
    a("--num-query-groups", type=int, default=None)
    a("--ffn-hidden-size", type=int, default=None)
    a("--seq-length", type=int, default=128)
    a("--vocab-size", type=int, default=32000)
    a("--micro-batch-size", type=int, default=1)
    a("--num-microbatches", type=int, default=None)
    a("--global-batch-size", type=int, default=None)
    a("--tensor-model-parallel-size", type=int, default=1)
    a("--sequence-parallel", action="store_true")
    a("--pipeline-model-parallel-size", type=int, default=1)
    a("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    a("--virtual-pipeline-model-parallel-size", type=int, default=None)
    a("--expert-model-parallel-size", type=int, default=1)
    a("--num-experts", type=int, default=None)
    a("--moe-router-topk", type=int, default=2)
    a("--moe-ffn-hidden-size", type=int, default=None)
    a("--moe-token-dispatcher-type", default=None, choices=["allgather", "alltoall"])
    a("--transformer-impl", default="transformer_engine", choices=["transformer_engine", "local"])
    a("--bf16", action="store_true")
    a("--hidden-dropout", type=float, default=0.0, help="0 unless asked (Megatron-LM's default is 0.1)")
    a("--attention-dropout", type=float, default=0.0, help="0 unless asked (Megatron-LM's default is 0.1)")
    # off unless asked, as megatron-core's TransformerConfig leaves them (Megatron-LM turns RoPE fusion on; its
    # --no-rope-fusion turns it off): every earlier session's runs used the unfused paths
    a("--rope-fusion", action="store_true", help="TE's fused RoPE (apply_rope_fusion; Megatron-LM's default)")
    a("--fused-single-qkv-rope", action="store_true", help="one fused kernel splits the QKV output and rotates q, k")
    a("--moe-permute-fusion", action="store_true", help="TE's fused MoE token (un)permutation")
    a("--no-moe-grouped-gemm", action="store_true",
      help="TE spec: the experts as a SequentialMLP of TE linears, as Megatron-LM builds them without "
           "--moe-grouped-gemm (this script's TE default is TEGroupedMLP)")
    a("--recompute-granularity", default=None, choices=["full", "selective"])
    a("--recompute-modules", nargs="*", default=None)
    a("--recompute-method", default=None, choices=["uniform", "block"], help="with --recompute-granularity full")
    a("--recompute-num-layers", type=int, default=None, help="with --recompute-granularity full")
    a("--fp8", default=None, choices=["e4m3", "hybrid"], help="TransformerEngine FP8 (GPU)")
    a("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    a("--attention-backend", default="auto", choices=["auto", "flash", "fused", "unfused", "local"],
      help="TE attention backend, as in Megatron-LM (sets NVTE_FLASH_ATTN / NVTE_FUSED_ATTN)")
    a("--eval-interval", type=int, default=0, help="every K training steps run a forward-only evaluation")
    a("--eval-iters", type=int, default=2, help="microbatches per evaluation")
    add_offload_args(p)  # the three flags as Megatron-LM scripts get them
    a("--audit-offloaded", action="store_true",
      help="after every step, check in bytes that no offloaded storage was a parameter, main_grad or TE FP8 "
           "weight workspace (ours only; JSON field 'audit')")
    a("--without-pack-hooks", action="store_true",
      help="ours: the offload points never push their saved-tensor hooks, so nothing is packed and nothing moves; "
           "the points, groups and node hooks still run (what PyTorch's dispatch of the pack and unpack hooks "
           "costs: against a run with --min-offloaded-tensor-size above every tensor)")
    a("--without-node-hooks", action="store_true",
      help="ours: the offload points hook no autograd node (no group start or commit hook, no identity node), so "
           "backward never reloads a group; only with --min-offloaded-tensor-size above every tensor (nothing "
           "moves): what the node hooks cost")
    a("--train-iters", type=int, default=10)
    a("--warmup-steps", type=int, default=2, help="steps left out of the step-time median")
    a("--log-interval", type=int, default=1)
    a("--lr", type=float, default=1e-4)
    a("--seed", type=int, default=1234)
    a("--deterministic", action="store_true",
      help="deterministic kernels (torch deterministic algorithms, TE deterministic attention)")
    a("--cpu-bind", default="none", choices=["none", "gpu-local", "compact"],
      help="bind the rank to CPU cores (benchmarks/cpu_affinity.py): the GPU's NUMA node, or a block of it")
    a("--cpu-bind-cores", type=int, default=4, help="with --cpu-bind compact: cores per rank")
    a("--manual-gc", action="store_true",
      help="as in Megatron-LM: no automatic Python garbage collection; collect between steps (untimed)")
    a("--manual-gc-interval", type=int, default=1, help="with --manual-gc: collect every K steps")
    a("--memory-timeline", action="store_true", help="log allocated memory around every microbatch")
    a("--peak-trace", action="store_true",
      help="record the allocator's history in the step whose peak is reported: where the peak was reached and the "
           "reloaded bytes live then (benchmarks/peak_trace.py); JSON 'peak_trace'")
    a("--peak-trace-census", action="store_true",
      help="--peak-trace recording from the launch, and what is allocated at the peak step's start after its "
           "zero_grad, by call path (weights, persistent buffers, workspaces); JSON 'peak_trace' 'census'")
    a("--profile-steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
      help="torch.profiler trace of these steps (inclusive), summarised by trace_analysis.py; each step's schedule "
           "is the range 'bench step N on|off' (trace_step_ops.py compares offloaded and plain steps)")
    a("--alternate-offload", action="store_true",
      help="every odd step runs without offloading (ours: inside mcore_offload.paused(); native on megatron-core "
           "0.16: its switches off, benchmarks/native_pause.py), so one process times both kinds under the same "
           "host drift; JSON 'alternation': paired overhead with a 95%% interval, Δpeak")
    a("--alternate-runtime", nargs="+", default=None, metavar="KEY=VALUE",
      help="ours: every step offloads, the offloaded steps of the alternation with these runtime settings "
           "(flush_layers=N, reload_layers=N, prefetch=layer|tail|late) and the others with the runtime's own "
           "(benchmarks/runtime_switch.py): "
           "JSON 'alternation' is their cost over the defaults, 'alternate_runtime' what each step held")
    a("--alternate-period", type=int, default=2, choices=(2, 3),
      help="with --alternate-offload, --host-delay-us or --dma-load-mib: one step in N is the offloaded (delayed, "
           "loaded) one. 3 puts those steps on even and odd steps in turn, so an effect of a step's parity cancels, "
           "and reports that effect from the plain steps (JSON 'alternation' 'plain_steps'); 2 has more pairs")
    a("--alternate-block", type=int, default=None, metavar="B",
      help="with --alternate-offload: alternate blocks of B steps (from the warm-up's end: B plain, B offloaded, ...) "
           "instead of single steps; each offloaded block's median over its plain neighbours', the first step of "
           "every block left out (a switch's own cost lands there). JSON 'alternation' as for single steps")
    a("--offload-paused", action="store_true",
      help="ours: every step runs inside mcore_offload.paused(), so the patches and the runtime are in place and "
           "nothing is offloaded: against a run without --fine-grained-activation-offloading, what their presence "
           "costs a step")
    a("--offload-first-steps", type=int, default=None, metavar="K",
      help="ours: offload in steps 0..K-1 only, then run every step inside mcore_offload.paused() "
           "(benchmarks/offload_stop.py): do plain steps stay slower once offloading has run? JSON 'offload_stop'")
    a("--offload-from-step", type=int, default=0, metavar="S",
      help="with --offload-first-steps K: offload in steps S..K-1 only; the steps before S are plain too, so one "
           "process times plain steps before offloading ever ran and after it stopped (JSON 'offload_stop')")
    a("--at-offload-stop", default="keep", choices=("keep", "empty-cache", "release-host", "both"),
      help="with --offload-first-steps: what to release before step K (untimed): nothing, the device caching "
           "allocator's free segments, our pinned host buffers and PyTorch's cached pinned blocks, or both")
    a("--spare-streams", type=int, default=0, metavar="N",
      help="take N streams from PyTorch's pool before the first step and never use them, as our runtime takes its "
           "two copy streams: whether that alone moves NCCL's streams to slower hardware queues (no offloading "
           "needed; benchmarks/state_probes.py, mcore_offload/runtime/side_streams.py)")
    a("--pin-host-gib", type=float, default=0.0, metavar="G",
      help="hold G GiB of pinned host memory from before the first step, never used (benchmarks/state_probes.py)")
    a("--touch-transport", action="store_true",
      help="ours, with --offload-paused: make our transport (streams, events, CUDA runtime bindings) before the "
           "first step, offloading nothing (benchmarks/state_probes.py)")
    a("--touch-transport-step", type=int, default=0, metavar="S",
      help="with --touch-transport: make it before step S instead (S >= 1: after the first step has made NCCL's "
           "pipeline communicator, as in a run whose offloading starts late)")
    a("--host-delay-us", type=float, nargs=2, default=None, metavar=("FWD", "BWD"),
      help="every other step, spin FWD us at each transformer layer's forward and BWD us at its backward "
           "(benchmarks/host_delay.py): the paired overhead over the delay is the host time the step exposes; "
           "JSON 'alternation' and 'host_delay'")
    a("--dma-load-mib", type=float, nargs=2, default=None, metavar=("FWD", "BWD"),
      help="no offloading; every other step, copy FWD MiB device-to-host at each transformer layer's forward and "
           "BWD MiB host-to-device at its backward, on side streams, into buffers nothing reads "
           "(benchmarks/dma_load.py): the paired overhead is what the link traffic alone costs; JSON 'dma_load'")
    a("--dma-load-every-layer", action="store_true",
      help="with --dma-load-mib: copy at each chunk's last layer too (by default it is left out, as the runtime "
           "keeps a chunk's last layer on the device where the chunk's backward comes before any flush; under "
           "pipelining that is rare: on D-dense's rank 0 ours moves every layer of every chunk)")
    a("--evict-core-attn-mib", type=float, default=0.0, metavar="N",
      help="in every step, write N MiB of host memory at each core attention's start and linear_proj's start and "
           "at the two matching moments of backward (benchmarks/cache_evict.py): whether the points' cost is what "
           "they evict from the core's caches; JSON 'cache_evict'")
    a("--core-attn-spin-us", type=float, default=0.0, metavar="U",
      help="--evict-core-attn-mib's control: spin U us at the same moments, writing nothing; JSON 'cache_evict'")
    a("--time-syncs", action="store_true",
      help="host time blocked in Tensor.cpu/.item/.tolist of CUDA tensors and in Event/Stream.synchronize per step "
           "(benchmarks/sync_wait.py); JSON 'sync_wait'")
    a("--runtime-breakdown", action="store_true",
      help="ours: time each offload-runtime function from the first timed step (benchmarks/runtime_breakdown.py)")
    a("--cprofile-steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"),
      help="cProfile these steps (inclusive) with autograd on the main thread, so that backward's Python "
           "(hooks, TE's backward functions) is profiled too; writes cprofile_rank*.txt to --profile-dir")
    a("--sample-stacks", type=float, default=None, metavar="HZ",
      help="sample the main thread's Python stack HZ times a CPU second in each step from --warmup-steps on, "
           "offloaded and plain steps apart (benchmarks/stack_sampler.py); JSON 'stack_samples'")
    a("--profile-dir", default="profile", help="where traces and their summaries go")
    a("--json-out", default=None, help="write every rank's results here (rank 0)")
    a("--label", default="", help="free text stored in the JSON")
    args = p.parse_args(argv)
    if args.evict_core_attn_mib and args.core_attn_spin_us:
        p.error("--evict-core-attn-mib and --core-attn-spin-us are two kinds of the same probe: give one")
    if args.no_moe_grouped_gemm and not (args.num_experts and args.transformer_impl == "transformer_engine"):
        p.error("--no-moe-grouped-gemm chooses the experts' module of the TE spec: add --num-experts N "
                "(the local spec always uses SequentialMLP)")
    if sum(map(bool, (args.alternate_offload, args.host_delay_us, args.dma_load_mib, args.alternate_runtime))) > 1:
        p.error("--alternate-offload, --alternate-runtime, --host-delay-us and --dma-load-mib each alternate steps "
                "themselves: use one of them per run")
    if args.offload_paused and (args.alternate_offload or args.alternate_runtime
                                or not args.fine_grained_activation_offloading):
        p.error("--offload-paused keeps our runtime idle in every step: use it with --fine-grained-activation-"
                "offloading and --offload-modules, without --alternate-offload or --alternate-runtime")
    if args.offload_first_steps is not None and (args.alternate_offload or args.alternate_runtime
                                                 or args.offload_paused
                                                 or not args.fine_grained_activation_offloading):
        p.error("--offload-first-steps offloads in the first K steps only: use it with --fine-grained-activation-"
                "offloading and --offload-modules, without --alternate-offload, --alternate-runtime or "
                "--offload-paused")
    if args.offload_from_step and (args.offload_first_steps is None
                                   or not 0 <= args.offload_from_step < args.offload_first_steps):
        p.error("--offload-from-step S starts the offloaded steps S..K-1: add --offload-first-steps K with K > S >= 0")
    if args.without_pack_hooks and not args.fine_grained_activation_offloading:
        p.error("--without-pack-hooks runs our offload points without their saved-tensor hooks: add "
                "--fine-grained-activation-offloading --offload-modules ...")
    if args.without_node_hooks and (not args.fine_grained_activation_offloading
                                    or args.min_offloaded_tensor_size < 10**12):
        p.error("--without-node-hooks leaves offloaded groups without their reloads: use it with "
                "--fine-grained-activation-offloading --offload-modules ... and --min-offloaded-tensor-size "
                "1000000000000 or more, so that nothing moves")
    if args.touch_transport and not args.offload_paused:
        p.error("--touch-transport makes our transport without offloading: add --offload-paused (and "
                "--fine-grained-activation-offloading --offload-modules ...)")
    if args.touch_transport_step and not args.touch_transport:
        p.error("--touch-transport-step S says when --touch-transport makes our transport: add --touch-transport")
    if args.touch_transport_step < 0:
        p.error(f"--touch-transport-step must be >= 0 (a step number), not {args.touch_transport_step}")
    if args.at_offload_stop != "keep" and args.offload_first_steps is None:
        p.error("--at-offload-stop says what to release when offloading stops: add --offload-first-steps K")
    if args.alternate_runtime:
        from runtime_switch import parse_settings

        try:
            args.alternate_runtime = parse_settings(args.alternate_runtime)
        except ValueError as err:
            p.error(str(err))
        if not args.fine_grained_activation_offloading:
            p.error("--alternate-runtime compares two settings of our runtime: add "
                    "--fine-grained-activation-offloading and --offload-modules")
    if args.alternate_period != 2 and not (args.alternate_offload or args.alternate_runtime or args.host_delay_us
                                           or args.dma_load_mib):
        p.error("--alternate-period sets how steps alternate: add --alternate-offload (or --alternate-runtime, "
                "--host-delay-us, --dma-load-mib)")
    if args.dma_load_every_layer and not args.dma_load_mib:
        p.error("--dma-load-every-layer changes --dma-load-mib's layers: give --dma-load-mib FWD BWD too")
    if args.dma_load_mib and args.fine_grained_activation_offloading:
        p.error("--dma-load-mib measures the copies without the offload runtime: drop "
                "--fine-grained-activation-offloading")
    if args.alternate_block is not None and not (args.alternate_offload and args.alternate_period == 2
                                                 and args.alternate_block >= 2):
        p.error("--alternate-block B alternates blocks of offloaded and plain steps: use it with --alternate-offload, "
                "without --alternate-period, and B of at least 2")
    if args.alternate_offload and not args.fine_grained_activation_offloading:
        p.error("--alternate-offload compares offloaded with plain steps: add --fine-grained-activation-offloading "
                "and --offload-modules")
    if args.num_microbatches is None:
        args.num_microbatches = max(1, (args.global_batch_size or args.micro_batch_size) // args.micro_batch_size)
    if args.num_layers_per_virtual_pipeline_stage and not args.virtual_pipeline_model_parallel_size:
        per_stage = args.num_layers // args.pipeline_model_parallel_size
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    return args

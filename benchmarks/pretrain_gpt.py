"""GPT / MoE pretraining on mock tokens with megatron-core, Megatron-LM-style flags, launched by torchrun.

    torchrun --nproc-per-node 1 benchmarks/pretrain_gpt.py --num-layers 16 --hidden-size 2048 \
        --num-attention-heads 16 --ffn-hidden-size 8192 --seq-length 4096 --micro-batch-size 1 \
        --num-microbatches 4 --bf16 --transformer-impl transformer_engine --train-iters 10 \
        --fine-grained-activation-offloading --offload-modules core_attn --json-out run.json

Logs loss, step time and per-rank peak memory; writes one JSON with every rank's numbers. The same
script runs on upstream megatron-core 0.16.1, whose native implementation reads the same config fields.
On megatron-core 0.15.x the offload flags need ``mcore-offload patch apply`` first.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("pretrain_gpt")
BENCHMARKS = Path(__file__).resolve().parent
if str(BENCHMARKS) not in sys.path:  # the helper modules beside this script, also when it is imported
    sys.path.insert(0, str(BENCHMARKS))
import point_switches  # noqa: E402
import pretrain_args  # noqa: E402
from host_clock import HostClock  # noqa: E402
from offload_stop import offload_stop_summary, release_after_offloading  # noqa: E402
from pretrain_model import build_config, build_model  # noqa: E402
from run_info import native_accounting, ours_results, peak_reader, versions  # noqa: E402
from state_probes import take_probes  # noqa: E402

# the caching allocator's layout after the last step (torch.cuda.memory_stats keys)
ALLOCATOR_STATE = ("segment.all.current", "active.all.current", "inactive_split.all.current",
                   "inactive_split_bytes.all.current", "reserved_bytes.all.current", "oversize_segments.current")
# caching-allocator counters recorded per step (torch.cuda.memory_stats keys)
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def parse_args(argv=None) -> argparse.Namespace:
    return pretrain_args.parse_args(argv, __doc__)


def init_distributed(args) -> torch.device:
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if cuda:
        from cpu_affinity import bind

        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        args.cpus = bind(args.cpu_bind, local_rank, args.cpu_bind_cores)
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def batches(args, step: int, device):
    """Deterministic mock tokens for one step: the same for every run and every layout."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step)
    out = []
    for _ in range(args.num_microbatches):
        seq = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
        out.append({
            "tokens": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device),
            "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1).to(device),
            "loss_mask": torch.ones(args.micro_batch_size, args.seq_length, device=device),
        })
    return out


def run_schedule(args, chunks, fb, data: list[dict], forward_only: bool):
    """One call of megatron-core's schedule over ``data`` (one iterator per model chunk)."""
    iters = [iter(data) for _ in chunks] if len(chunks) > 1 else iter(data)
    return fb(forward_step_func=forward_step, data_iterator=iters, model=chunks if len(chunks) > 1 else chunks[0],
              num_microbatches=len(data), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
              forward_only=forward_only)


def mean_loss(out) -> float | None:
    """The mean of the microbatch losses the schedule returned (None where it returned none)."""
    return torch.stack([o["lm loss"] for o in out]).mean().item() if out else None


def evaluate(args, chunks, fb, step: int):
    """A forward-only pass in eval mode, as Megatron-LM's evaluate() runs it; returns the mean loss (last stage)."""
    from megatron.core import parallel_state

    for c in chunks:
        c.eval()
    data = batches(args, 10_000 + step, next(chunks[0].parameters()).device)[: args.eval_iters]
    with torch.no_grad():
        out = run_schedule(args, chunks, fb, data, forward_only=True)
    for c in chunks:
        c.train()
    return mean_loss(out) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else None


def loss_func(loss_mask, output_tensor):
    loss = (output_tensor.float() * loss_mask).sum() / loss_mask.sum()
    # clone: the schedule divides the returned loss in place by the number of microbatches
    return loss, {"lm loss": loss.detach().clone()}


TIMELINE: list[tuple[str, int]] | None = None


def _mark(what: str) -> None:
    if TIMELINE is not None:
        TIMELINE.append((what, torch.cuda.memory_allocated()))


def forward_step(data_iterator, model):
    b = next(data_iterator)
    _mark("fwd-start")
    out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
    _mark("fwd-end")
    if TIMELINE is not None and out.requires_grad:
        out.register_hook(lambda g: _mark("bwd-start"))
    return out, partial(loss_func, b["loss_mask"])


def main(argv=None) -> int:
    from step_profiling import GcClock, annotate_offload_runtime, start_cprofile, stop_cprofile, write_profile

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.deterministic:
        # MoE token (un)permutation uses scatter_add, nondeterministic on CUDA unless asked.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.attention_backend in ("flash", "fused", "unfused"):
        # What Megatron-LM does for --attention-backend: TE picks its backend from these variables.
        os.environ["NVTE_FLASH_ATTN"] = "1" if args.attention_backend == "flash" else "0"
        os.environ["NVTE_FUSED_ATTN"] = "1" if args.attention_backend == "fused" else "0"
    device = init_distributed(args)
    probes = take_probes(device, args.spare_streams, args.pin_host_gib,  # held for the run
                         args.touch_transport and not args.touch_transport_step)
    rank, world = dist.get_rank(), dist.get_world_size()
    import megatron.core as mc
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ours = args.fine_grained_activation_offloading and mc.__version__.startswith("0.15")
    if ours:
        import mcore_offload

        mcore_offload.ensure_patched()
        if args.without_pack_hooks:
            point_switches.without_pack_hooks()
        if args.without_node_hooks:
            point_switches.without_node_hooks()
    alternate = args.alternate_offload or bool(args.host_delay_us) or bool(args.dma_load_mib) \
        or bool(args.alternate_runtime)
    switch = None  # --alternate-runtime: our runtime's settings, switched between steps
    if (args.without_pack_hooks or args.without_node_hooks) and not ours:
        raise SystemExit("--without-pack-hooks and --without-node-hooks take parts of mcore_offload's points away: "
                         "run them on megatron-core 0.15 with our patches")
    if args.offload_paused and not ours:
        raise SystemExit("--offload-paused idles mcore_offload's runtime: run it on megatron-core 0.15 with our "
                         "patches")
    if args.alternate_runtime:
        if not ours:
            raise SystemExit("--alternate-runtime switches mcore_offload's settings: run it on megatron-core 0.15 "
                             "with our patches, not on upstream's native offloading")
        from runtime_switch import RuntimeSwitch

        switch = RuntimeSwitch(args.alternate_runtime)
    if args.peak_trace_census and device.type == "cuda":  # before the model: its weights get call paths
        from peak_trace import PeakTrace

        PeakTrace.record_from_launch()
    config = build_config(args)
    chunks = build_model(args, config)
    native_pause = None  # native's switches on megatron-core 0.16, off in plain steps (alternation or window)
    if (args.alternate_offload or args.offload_first_steps is not None) and not ours:
        from native_pause import NativePause

        native_pause = NativePause(chunks)
    side_load = None  # HostDelay or DmaLoad: work added to every other step
    if args.host_delay_us:
        from host_delay import HostDelay

        side_load = HostDelay(*args.host_delay_us)
        side_load.install(chunks)
    elif args.dma_load_mib:
        from dma_load import DmaLoad

        side_load = DmaLoad(*args.dma_load_mib, device)
        side_load.install(chunks, skip_last=not args.dma_load_every_layer)
    evictor = None  # --evict-core-attn-mib / --core-attn-spin-us: the same work around core attention in every step
    if args.evict_core_attn_mib or args.core_attn_spin_us:
        from cache_evict import CoreAttnEvict

        evictor = CoreAttnEvict(args.evict_core_attn_mib, args.core_attn_spin_us)
        evictor.install(chunks)
    syncs = None
    if args.time_syncs:
        from sync_wait import SyncWait

        syncs = SyncWait()
        syncs.install()
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.SGD(params, lr=args.lr)
    fb = get_forward_backward_func()
    global TIMELINE
    if args.memory_timeline and device.type == "cuda":
        TIMELINE = []
        logging.getLogger("mcore_offload").setLevel(logging.DEBUG)
    cuda = device.type == "cuda"
    on_steps: list[bool] = []  # False: a step run inside mcore_offload.paused() (--alternate-offload)
    step_peaks: list[int] = []
    losses, step_ms, issue_ms, allocated_after, eval_losses = [], [], [], [], []
    gc_clock = GcClock()
    host_clock = HostClock()  # what the machine did in each step (steal, other load, the thread's CPU time)
    block_on = None  # --alternate-block: which steps offload
    if args.alternate_block:
        from paired_steps import block_on_steps

        block_on = block_on_steps(args.train_iters, args.warmup_steps, args.alternate_block)
    peak_step = 1
    if ours and any(m.startswith("auto") for m in args.offload_modules):
        from mcore_offload.runtime.auto import PROBE_STEPS

        peak_step = PROBE_STEPS
    if args.manual_gc:
        gc.collect()
        gc.disable()
    peak_step1, at_peak = None, None
    tracer = None  # --peak-trace: a PeakTrace during the peak step
    peak_trace: dict[str, Any] | None = None  # what it found
    allocator: dict[str, list[int]] = {key: [] for key in ALLOCATOR_COUNTERS}
    prof = None
    audit = None
    if ours and args.audit_offloaded:
        from mcore_offload.audit import OffloadAudit

        audit = OffloadAudit()
    if args.profile_steps:
        annotate_offload_runtime()
    breakdown = None
    if ours and args.runtime_breakdown:
        from runtime_breakdown import RuntimeBreakdown

        breakdown = RuntimeBreakdown()
        breakdown.install()
    sampler = None
    if args.sample_stacks:
        from stack_sampler import StackSampler

        sampler = StackSampler(args.sample_stacks, args.warmup_steps)
        sampler.install()
    for step in range(args.train_iters):
        if args.cprofile_steps and step == args.cprofile_steps[0]:
            cprof = start_cprofile()
        if args.profile_steps and step == args.profile_steps[0]:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
            prof.__enter__()
        if cuda and step == peak_step:
            # Step 0 allocates the optimizer-free model's gradients and autotunes; peaks are read from step 1
            # (with offload_modules=["auto"], from its first planned step: the steps before it probe).
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if ours:
                from mcore_offload.summary import get_summary

                get_summary().track_peak(peak_reader(device))
            if args.peak_trace or args.peak_trace_census:
                from peak_trace import PeakTrace

                tracer = PeakTrace(device, from_launch=args.peak_trace_census)
                tracer.start()
        if breakdown is not None and step == args.warmup_steps:
            breakdown.recording = True
        if args.touch_transport_step and step == args.touch_transport_step:
            probes += take_probes(device, 0, 0.0, True)
        data = batches(args, step, device)
        opt.zero_grad(set_to_none=True)
        if tracer is not None and args.peak_trace_census and step == peak_step:
            tracer.take_census()
        if cuda:
            torch.cuda.synchronize()
            if alternate:  # every step's own peak (the step-1 peak above is still read as usual)
                torch.cuda.reset_peak_memory_stats()
        stopped = args.offload_first_steps is not None and not \
            args.offload_from_step <= step < args.offload_first_steps
        if stopped and step == args.offload_first_steps:
            release_after_offloading(args.at_offload_stop)
        on_steps.append(not args.offload_paused and not stopped
                        and (not alternate or (block_on[step] if block_on else step % args.alternate_period == 0)))
        if side_load is not None:
            side_load.active = on_steps[-1]
        if switch is not None:
            switch.start_step(on_steps[-1])
        gc_clock.start_step()
        host_clock.start_step()
        if sampler is not None:
            sampler.start_step(on_steps[-1])
        t0 = time.perf_counter()
        if syncs is not None:
            syncs.start_step()
        plain = (args.alternate_offload and not on_steps[-1]) or args.offload_paused or stopped
        # under --profile-steps, each step's schedule is a named range (trace_step_ops.py compares on and off)
        mark = torch.profiler.record_function(f"bench step {step} {'on' if on_steps[-1] else 'off'}") \
            if prof is not None else contextlib.nullcontext()
        with mark, (native_pause.paused() if native_pause is not None else mcore_offload.paused()) if plain \
                else contextlib.nullcontext():
            out = run_schedule(args, chunks, fb, data, forward_only=False)
        if syncs is not None:
            syncs.end_step()
        opt.step()
        # the host's share: a step whose host issues its work well before the GPU ends is not launch-bound
        issue_ms.append((time.perf_counter() - t0) * 1e3)
        host_clock.issued()
        if sampler is not None:
            sampler.end_step()
        if cuda:
            torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        host_clock.end_step()
        if switch is not None:
            switch.end_step()
        if alternate and cuda:
            step_peaks.append(torch.cuda.max_memory_allocated())
        gc_clock.end_step()
        if audit is not None:  # untimed: walks every parameter and module
            audit.check(chunks)
        if args.manual_gc and (step + 1) % args.manual_gc_interval == 0:
            gc.collect()
        if args.cprofile_steps and step == args.cprofile_steps[1]:
            stop_cprofile(cprof, args, rank)
        if prof is not None and step == args.profile_steps[1]:
            prof.__exit__(None, None, None)
            write_profile(prof, args, rank)
            prof = None
        if cuda and step == peak_step:
            if tracer is not None:
                peak_trace = tracer.stop()
            peak_step1 = torch.cuda.max_memory_allocated()
            if ours:
                get_summary().stop_tracking_peak()
                at_peak = get_summary().off_device_at_peak_bytes
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            loss = mean_loss(out)
            loss = float("nan") if loss is None else loss
        else:
            loss = None
        losses.append(loss)
        allocated_after.append(torch.cuda.memory_allocated() if cuda else None)
        if cuda:  # untimed: device mallocs / frees / retries in the step (each costs ms; a free syncs)
            stats = torch.cuda.memory_stats()
            for key in ALLOCATOR_COUNTERS:
                allocator[key].append(stats.get(key, 0) - sum(allocator[key]))
        if args.eval_interval and (step + 1) % args.eval_interval == 0:
            eval_losses.append(evaluate(args, chunks, fb, step))
        if rank == 0 and step % args.log_interval == 0 or (loss is not None and rank == world - 1
                                                            and step % args.log_interval == 0):
            logger.info("rank %d step %d/%d loss %s step %.1f ms peak %.2f GiB", rank, step + 1,
                        args.train_iters, "-" if loss is None else f"{loss:.6f}", step_ms[-1],
                        torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    timed = step_ms[args.warmup_steps:] or step_ms
    row = {
        "rank": rank, "pid": os.getpid(), "label": args.label, "impl_version": mc.__version__,
        "runtime_env": {k: v for k, v in os.environ.items() if k.startswith("MCORE_OFFLOAD_")},
        "losses": losses, "loss_hex": [None if x is None else float(x).hex() for x in losses],
        "step_ms": step_ms, "step_ms_median": statistics.median(timed), "timed_steps": len(timed),
        "issue_ms": issue_ms, "issue_ms_median": statistics.median(issue_ms[args.warmup_steps:] or issue_ms),
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_bytes_step1": peak_step1, "peak_step": peak_step,
        "peak_trace": peak_trace,
        "allocated_after_step": allocated_after, "eval_losses": eval_losses,
        "versions": versions(),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "memory_timeline_MiB": [(w, round(b / 2**20, 1)) for w, b in TIMELINE or []],
        "offload_modules": args.offload_modules if args.fine_grained_activation_offloading else [],
        "allocator_per_step": allocator if cuda else None,
        "state_probes": {"spare_streams": args.spare_streams, "pin_host_gib": args.pin_host_gib,
                         "touch_transport": args.touch_transport, "touch_transport_step": args.touch_transport_step},
        "without_pack_hooks": args.without_pack_hooks, "without_node_hooks": args.without_node_hooks,
        "cpu_bind": args.cpu_bind, "cpus": getattr(args, "cpus", None), "loadavg": os.getloadavg(),
        "gc_ms": gc_clock.per_step, "gc_collections": gc_clock.collections,
        "gc_ms_median": statistics.median(gc_clock.per_step[args.warmup_steps:] or gc_clock.per_step),
        "host_clock": host_clock.as_dict(),
    }
    if sampler is not None:
        sampler.uninstall()
        row["stack_samples"] = sampler.as_dict()
    if args.offload_first_steps is not None:  # the plain steps from two after the stop, and any before the start
        row["offload_stop"] = offload_stop_summary(step_ms, args.warmup_steps, args.offload_from_step,
                                                   args.offload_first_steps, args.at_offload_stop)
    if cuda:  # how the caching allocator's memory is laid out after the last step
        stats = torch.cuda.memory_stats()
        row["allocator_state"] = {key: stats.get(key) for key in ALLOCATOR_STATE}
    if ours:
        row.update(ours_results(args, on_steps, switch is not None, at_peak, breakdown, audit, rank))
        from mcore_offload.runtime.manager import get_manager

        row["node_hooks"] = get_manager().node_hooks  # what the runtime used (False: --without-node-hooks)
    elif args.fine_grained_activation_offloading:
        row.update(native_accounting())
    if evictor is not None:
        row["cache_evict"] = evictor.as_dict(len(step_ms))
    if syncs is not None:
        syncs.uninstall()
        row["sync_wait"] = syncs.as_dict(on_steps if alternate else None, args.warmup_steps)
    if alternate:
        from paired_steps import alternation_summary, first_counted_step

        first = first_counted_step(args.warmup_steps, args.alternate_period, args.alternate_block)
        row["alternation"] = alternation_summary(step_ms, on_steps, first, step_peaks if cuda else None, issue_ms,
                                                 block=args.alternate_block)
        row["alternation"]["on_steps"] = on_steps
        row["alternation"]["step_peaks"] = step_peaks
        if side_load is not None:
            row["dma_load" if args.dma_load_mib else "host_delay"] = side_load.as_dict(sum(on_steps))
        if switch is not None:
            row["alternate_runtime"] = switch.as_dict(row["offload"]["per_step"], on_steps, args.warmup_steps)
        logger.info("rank %d alternating steps: %s %s", rank,
                    {k: v for k, v in row["alternation"].items() if k not in ("on_steps", "step_peaks")},
                    row.get("host_delay", row.get("dma_load", "")))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "ranks": rows}, f, indent=1)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

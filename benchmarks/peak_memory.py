"""Per-rank peak memory and step time of offloading: baseline, ours and upstream's native implementation.

Each (implementation, offload set) pair of a model configuration runs as its own torchrun process of
``benchmarks/pretrain_gpt.py``, one after the other (never concurrently: step times are measured):

- ``baseline``: no offloading, once per megatron-core tree in use;
- ``ours``: megatron-core 0.15.x patched by ``mcore-offload patch apply`` (``--ours-megatron``);
- ``native``: upstream megatron-core 0.16.1's own implementation (``--native-megatron``), same config fields.

    python benchmarks/peak_memory.py --config A C --impls baseline ours native \\
        --ours-megatron /root/mc-0.15.3 --native-megatron /root/mc-0.16.1 --out results/pp1

Per rank it reports peak allocated bytes (read from step 1 on), Δpeak against the baseline on the same
megatron-core, the offloaded bytes off the device at the moment of the peak (ours: measured; native: its own
accounting, labelled), R = Δpeak / those bytes, the median step time after warm-up, the overhead against
the baseline, and whether the loss sequence is bitwise the baseline's. Output in ``--out``:
``results.json``, ``results.md`` and ``peak_memory.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("peak_memory")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package under test, also when it is not installed
    sys.path.insert(0, str(ROOT))

from mcore_offload.config import validate_offload_modules  # noqa: E402

PP1 = "--seq-length 4096 --micro-batch-size 1 --bf16 --transformer-impl transformer_engine --deterministic"
DENSE_A = "--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192"
DENSE_B = "--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 14336"
MOE_C = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 8192 --num-experts 16 "
         "--moe-router-topk 4 --moe-ffn-hidden-size 1024")
ATTN = ["qkv_linear", "core_attn", "attn_proj"]
EXPERTS = ["expert_fc1", "moe_act"]
AUTO = ["auto"]  # ours only: upstream has no such mode (native runs skip it)
TINY = ("--transformer-impl local --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--vocab-size 256 --micro-batch-size 2 --num-microbatches 2 --min-offloaded-tensor-size 1024")


@dataclass(frozen=True)
class Config:
    """One model configuration of the matrix and the offload sets measured on it."""

    model: str
    sets: list[list[str]]
    nproc: int = 1
    extra: str = ""
    description: str = ""
    cpu: bool = False  # runs on a machine without a GPU (local spec, gloo, CPU shims)


CONFIGS: dict[str, Config] = {
    "A": Config(f"{DENSE_A} {PP1} --num-microbatches 4", [["core_attn"], ATTN, AUTO],
                description="dense, 16 layers, hidden 2048, 16 heads, ffn 8192, PP=1, 4 microbatches"),
    "B": Config(f"{DENSE_B} {PP1} --num-microbatches 4", [["core_attn"], ATTN, AUTO],
                description="dense, 8 layers, hidden 4096, 32 heads, ffn 14336, PP=1, 4 microbatches"),
    "C": Config(f"{MOE_C} {PP1} --num-microbatches 4", [EXPERTS, ATTN + EXPERTS, AUTO],
                description="MoE, 8 layers, hidden 2048, 16 experts, top-4, moe-ffn 1024, PP=1, 4 microbatches"),
    "D-dense": Config(f"{DENSE_A} {PP1} --num-microbatches 8 --pipeline-model-parallel-size 2 "
                      "--virtual-pipeline-model-parallel-size 2", [["core_attn"], ATTN], nproc=2,
                      description="A's model at PP=2 x VPP=2, 8 microbatches, 2 GPUs"),
    "D-moe": Config(f"{MOE_C} {PP1} --num-microbatches 8 --pipeline-model-parallel-size 2 "
                    "--virtual-pipeline-model-parallel-size 2", [EXPERTS, ATTN + EXPERTS], nproc=2,
                    description="C's model at PP=2 x VPP=2, 8 microbatches, 2 GPUs"),
    # Issue-6 layouts (compatibility): loss equality and lower peaks with TP+SP (dense and MoE), EP (alltoall),
    # PP x VPP x TP.
    "E-tp2sp": Config(f"{DENSE_A} {PP1} --num-microbatches 4 --tensor-model-parallel-size 2 --sequence-parallel",
                      [["core_attn"], ATTN], nproc=2, description="A's model at TP=2 with sequence parallel, 2 GPUs"),
    "E-pp2": Config(f"{DENSE_A} {PP1} --num-microbatches 8 --pipeline-model-parallel-size 2",
                    [["core_attn"], ATTN], nproc=2,
                    description="A's model at PP=2 without VPP (plain 1F1B), 8 microbatches, 2 GPUs"),
    # MoE under TP needs sequence parallel (megatron-core refuses it otherwise); the experts are TP-sharded too
    # (expert_tensor_parallel_size defaults to TP) and tokens go through the allgather dispatcher
    "E-tp2moe": Config(f"{MOE_C} {PP1} --num-microbatches 4 --tensor-model-parallel-size 2 --sequence-parallel",
                       [EXPERTS, ATTN + EXPERTS], nproc=2,
                       description="C's model at TP=2 with sequence parallel (allgather dispatcher), 2 GPUs"),
    "E-ep2": Config(f"{MOE_C} {PP1} --num-microbatches 4 --expert-model-parallel-size 2 "
                    "--moe-token-dispatcher-type alltoall", [EXPERTS, ATTN + EXPERTS], nproc=2,
                    description="C's model at EP=2 (alltoall dispatcher), 2 GPUs"),
    "E-pp2vpp2tp2": Config(f"{DENSE_A} {PP1} --num-microbatches 8 --pipeline-model-parallel-size 2 "
                           "--virtual-pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
                           "--sequence-parallel",
                           [["core_attn"], ATTN], nproc=4, description="A's model at PP=2 x VPP=2 x TP=2 (SP), 4 GPUs"),
    "tiny-dense": Config(TINY, [["core_attn"], ATTN, AUTO], cpu=True, description="CPU smoke: tiny dense, local spec"),
    "tiny-moe": Config(f"{TINY} --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64", [EXPERTS],
                       cpu=True, description="CPU smoke: tiny MoE, local spec"),
}


@dataclass
class Run:
    config: str
    impl: str  # baseline | ours | native
    megatron: str | None  # megatron-core tree put first on PYTHONPATH (None: the installed one)
    modules: list[str] = field(default_factory=list)
    result: dict | None = None
    rep: int = 0  # repetition (--repeat): every repetition runs the whole list again, so variants interleave

    @property
    def key(self) -> tuple:
        return (self.config, self.impl, self.megatron, tuple(self.modules))

    @property
    def name(self) -> str:
        tree = Path(self.megatron).name if self.megatron else "installed"
        return f"{self.config}__{self.impl}__{tree}__{'+'.join(self.modules) or 'none'}" + (
            f"__r{self.rep}" if self.rep else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", nargs="+", required=True, choices=sorted(CONFIGS), help="configurations to run")
    p.add_argument("--impls", nargs="+", default=["baseline", "ours"], choices=["baseline", "ours", "native"])
    p.add_argument("--ours-megatron", default=None, help="megatron-core 0.15.x tree patched by mcore-offload")
    p.add_argument("--native-megatron", default=None, help="megatron-core 0.16.x tree (upstream's native offloading)")
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--warmup-steps", type=int, default=2, help="steps before the timed ones (median of the rest)")
    p.add_argument("--timeout", type=int, default=400, help="seconds per run")
    p.add_argument("--out", required=True, help="result folder")
    p.add_argument("--sets", nargs="*", default=None,
                   help="these offload sets instead of the configuration's, written with '+' "
                        "(core_attn, qkv_linear+core_attn+attn_proj, auto)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the whole list N times, interleaved; step time = median of the runs' medians")
    p.add_argument("--extra", default="", help="more pretrain_gpt.py flags for every run")
    args = p.parse_args(argv)
    if "native" in args.impls and not args.native_megatron:
        p.error("--impls native needs --native-megatron DIR (a megatron-core 0.16.x tree); add it or drop native")
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    for s in args.sets or []:
        try:
            validate_offload_modules(s.split("+"))
        except ValueError as e:
            p.error(f"--sets {s}: {e}")
    if args.train_iters - args.warmup_steps < 1:
        p.error("--train-iters must exceed --warmup-steps so that some steps are timed")
    return args


def plan_runs(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    for name in args.config:
        cfg = CONFIGS[name]
        if cfg.cpu and "native" in args.impls:
            raise SystemExit(f"config {name} runs on the CPU, where upstream's native offloading (CUDA streams) "
                             "cannot run; drop native from --impls")
        trees = []
        if "ours" in args.impls or "baseline" in args.impls:
            trees.append(("ours", args.ours_megatron))
        if "native" in args.impls:
            trees.append(("native", args.native_megatron))
        for impl, tree in trees:
            runs.append(Run(name, "baseline", tree))
            if impl in args.impls:
                sets = [s.split("+") for s in args.sets] if args.sets else cfg.sets
                runs.extend(Run(name, impl, tree, list(s)) for s in sets if not (impl == "native" and s == AUTO))
    once = list(runs)
    for rep in range(1, args.repeat):
        runs.extend(Run(r.config, r.impl, r.megatron, list(r.modules), rep=rep) for r in once)
    return runs


def merge_repeats(runs: list[Run]) -> list[Run]:
    """One run per variant: the first repetition's result, its step time the median of all repetitions'.

    Each rank keeps every repetition's median (``step_ms_medians``); a repetition whose losses differ from the
    first's makes the variant's losses unequal to everything (``loss_hex`` set to None).
    """
    merged: dict[tuple, Run] = {}
    for run in runs:
        first = merged.setdefault(run.key, run)
        if run.result is None or first.result is None:
            if run.result is None:
                first.result = None
            continue
        for mine, theirs in zip(first.result["ranks"], run.result["ranks"]):
            mine.setdefault("step_ms_medians", [mine["step_ms_median"]])
            if run is not first:
                mine["step_ms_medians"].append(theirs["step_ms_median"])
                if mine["loss_hex"] != theirs["loss_hex"]:
                    mine["loss_hex"] = [None]
    for run in merged.values():
        for rank in (run.result or {}).get("ranks", []):
            rank["step_ms_median"] = statistics.median(rank["step_ms_medians"])
    return list(merged.values())


def launch(run: Run, args: argparse.Namespace, out: Path, port: int) -> dict | None:
    cfg = CONFIGS[run.config]
    script = ROOT / "benchmarks" / ("cpu_launch.py" if cfg.cpu else "pretrain_gpt.py")
    flags = [*cfg.model.split(), *cfg.extra.split(), *args.extra.split(), "--train-iters", str(args.train_iters),
             "--warmup-steps", str(args.warmup_steps), "--json-out", str(out / f"{run.name}.json"),
             "--label", run.name]
    if run.modules:
        flags += ["--fine-grained-activation-offloading", "--offload-modules", *run.modules]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(cfg.nproc),
           "--master-port", str(port), str(script), *flags]
    env = dict(os.environ)
    paths = [p for p in (run.megatron, str(ROOT)) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else paths)
    log = out / f"{run.name}.log"
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not (out / f"{run.name}.json").exists():
        logger.error("run %s failed (exit %s); see %s", run.name, rc, log)
        return None
    return json.loads((out / f"{run.name}.json").read_text())


def _losses(result: dict) -> list[str] | None:
    for r in result["ranks"]:
        if any(x is not None for x in r["loss_hex"]):
            return r["loss_hex"]
    return None


def rows_for(runs: list[Run], hardware: dict) -> list[dict]:
    """One row per (run, rank); Δpeak, R, overhead and loss equality against the same tree's baseline."""
    rows = []
    for run in runs:
        if run.result is None:
            rows.append({"config": run.config, "impl": run.impl, "offload_modules": run.modules, "rank": None,
                         "failed": True, "megatron_core": None})
            continue
        base = next((b for b in runs if b.config == run.config and b.impl == "baseline"
                     and b.megatron == run.megatron and b.result is not None), None)
        base_ranks = {r["rank"]: r for r in base.result["ranks"]} if base else {}
        equal = (_losses(run.result) == _losses(base.result)) if base else None
        for r in run.result["ranks"]:
            b = base_ranks.get(r["rank"])
            peak = r["peak_bytes"]
            delta = (b["peak_bytes"] - peak) if b and peak is not None and b["peak_bytes"] is not None else None
            host = r.get("host_bytes_at_peak")
            overhead = (100.0 * (r["step_ms_median"] / b["step_ms_median"] - 1.0)) if b else None
            rows.append({
                "config": run.config, "impl": run.impl, "offload_modules": run.modules, "rank": r["rank"],
                "megatron_core": r["versions"]["megatron_core"],
                "peak_bytes": peak, "delta_peak_bytes": delta, "host_resident_bytes_at_peak": host,
                "host_bytes_source": r.get("host_bytes_source"),
                "R": (delta / host) if delta is not None and host else None,
                "step_ms_median": r["step_ms_median"], "timed_steps": r.get("timed_steps"),
                "step_ms_medians": r.get("step_ms_medians"),  # one per repetition (--repeat)
                "overhead_pct": overhead, "loss_equal": equal,
                "offloaded_bytes_by_point": {k: v["offloaded"] for k, v in
                                             r.get("offload", {}).get("last_step", {}).items()},
                "native_offload_bytes_by_point": r.get("native_offload_bytes_by_point"),
                # issue 5 telemetry, medians over the timed steps (ours only): compute-stream wait on reloads,
                # link throughput during copy bursts, host time inside the runtime, and GC time (all runs)
                "stall_ms": r.get("stall_ms"), "d2h_GBps": r.get("d2h_GBps"), "h2d_GBps": r.get("h2d_GBps"),
                "runtime_cpu_ms": r.get("runtime_cpu_ms"),
                "gc_ms": r.get("gc_ms_median"),
                "pinned_allocations": r.get("offload", {}).get("host_buffer_allocations"),
                "pinned_allocations_per_step": r.get("offload", {}).get("host_buffer_allocations_per_step"),
                # after-step allocated memory against the baseline's, step by step (issue 6: leaks)
                "allocated_after_step_max_abs_diff_bytes": _max_abs_diff(
                    r.get("allocated_after_step"), b.get("allocated_after_step") if b else None),
                "audit": r.get("audit"),  # --extra=--audit-offloaded: protected bytes offloaded (must be 0)
                "offload_steps": r.get("offload", {}).get("steps"),  # steps that offloaded (eval steps must not)
                "hardware": hardware, "versions": r["versions"], "run": run.name,
            })
    return rows


def _max_abs_diff(a: list | None, b: list | None) -> int | None:
    if not a or not b or len(a) != len(b) or any(x is None for x in a + b):
        return None
    return max(abs(x - y) for x, y in zip(a, b))


def _fmt(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x / scale:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    mib = 2**20
    head = ("| config | impl | megatron-core | offload_modules | rank | peak MiB | Δpeak MiB | off-device at peak MiB "
            "| R | step ms (median) | overhead % | stall ms | D2H GB/s | H2D GB/s | runtime host ms | GC ms "
            "| loss equal |")
    lines = [head, "|" + "---|" * 17]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['config']} | {r['impl']} | | {' '.join(r['offload_modules'])} | | FAILED |"
                         + " |" * 11)
            continue
        src = "" if r["impl"] != "native" or r["host_resident_bytes_at_peak"] is None else " (native's count)"
        lines.append(
            f"| {r['config']} | {r['impl']} | {r['megatron_core']} | {' '.join(r['offload_modules']) or '-'} "
            f"| {r['rank']} | {_fmt(r['peak_bytes'], mib)} | {_fmt(r['delta_peak_bytes'], mib)} "
            f"| {_fmt(r['host_resident_bytes_at_peak'], mib)}{src} | {_fmt(r['R'], 1, 2)} "
            f"| {_fmt(r['step_ms_median'])} | {_fmt(r['overhead_pct'], 1, 1)} | {_fmt(r.get('stall_ms'), 1, 2)} "
            f"| {_fmt(r.get('d2h_GBps'))} | {_fmt(r.get('h2d_GBps'))} | {_fmt(r.get('runtime_cpu_ms'), 1, 2)} "
            f"| {_fmt(r.get('gc_ms'), 1, 2)} | {r['loss_equal']} |")
    return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
    if r["impl"] == "baseline":
        return f"baseline (megatron-core {r['megatron_core']})"
    return f"{r['impl']}: {' '.join(r['offload_modules'])}"


def pyplot():
    """matplotlib's pyplot on the non-interactive backend, or None (logged) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return None
    return plt


def plot(rows: list[dict], path: Path) -> bool:
    """Per-rank peak memory, one panel per configuration: baseline / ours / native bars."""
    plt = pyplot()
    if plt is None:
        return False
    ok = [r for r in rows if not r.get("failed") and r["peak_bytes"] is not None]
    configs = list(dict.fromkeys(r["config"] for r in ok))
    if not configs:
        return False
    shades = {"baseline": ["#9a9a9a", "#c8c8c8"], "ours": ["#6fa8dc", "#1f5fa0"], "native": ["#f0b46c", "#c46a12"]}
    fig, axes = plt.subplots(1, len(configs), figsize=(5.2 * len(configs), 5.0), squeeze=False)
    for ax, cfg in zip(axes[0], configs):
        mine = [r for r in ok if r["config"] == cfg]
        labels = list(dict.fromkeys(_label(r) for r in mine))
        ranks = sorted({r["rank"] for r in mine})
        width = 0.8 / len(labels)
        seen: dict[str, int] = {}
        for i, label in enumerate(labels):
            impl = label.split()[0].rstrip(":")
            color = shades[impl][seen.get(impl, 0) % 2]
            seen[impl] = seen.get(impl, 0) + 1
            for rank in ranks:
                r = next((x for x in mine if x["rank"] == rank and _label(x) == label), None)
                if r is not None:
                    ax.bar(rank + i * width, r["peak_bytes"] / 2**30, width, color=color, edgecolor="black",
                           linewidth=0.4, label=label if rank == ranks[0] else None)
        ax.set_xticks([rank + 0.4 - width / 2 for rank in ranks], [f"rank {rank}" for rank in ranks])
        ax.set_ylabel("peak allocated (GiB)")
        ax.set_title(f"{cfg}: {CONFIGS[cfg].description}" if cfg in CONFIGS else cfg, fontsize=8)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def hardware_info() -> dict:
    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine()}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["gpus"] = torch.cuda.device_count()
        else:
            info["gpu"] = None
    except ImportError:
        pass
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.split("\n")[0] or None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = plan_runs(args)
    hardware = hardware_info()
    logger.info("%d runs on %s", len(runs), hardware.get("gpu") or "CPU")
    for i, run in enumerate(runs):
        t0 = time.time()
        run.result = launch(run, args, out, 29400 + i % 50)
        peaks = [r["peak_bytes"] for r in run.result["ranks"]] if run.result else []
        logger.info("[%d/%d] %s: %s in %.0f s%s", i + 1, len(runs), run.name, "ok" if run.result else "FAILED",
                    time.time() - t0, "" if not peaks or peaks[0] is None else
                    "; peak " + " ".join(f"{p / 2**30:.2f}" for p in peaks) + " GiB")
    rows = rows_for(merge_repeats(runs), hardware)
    (out / "results.json").write_text(json.dumps(
        {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
         "hardware": hardware, "configs": {c: CONFIGS[c].description for c in args.config}, "rows": rows},
        indent=1))
    table = markdown(rows)
    (out / "results.md").write_text(table)
    plot(rows, out / "peak_memory.png")
    print(table)
    return 0 if all(r.result for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

"""CPU microbenchmark: the host time offloading adds to a layer, per layer and microbatch.

``--pattern grouped`` (default): each layer has two offload points (``expert_fc1``, ``moe_act``); each point runs a
custom autograd Function that saves ``--experts`` views of one input storage and as many weight parameters, the
pattern of TEGroupedMLP. ``--pattern attention``: one ``core_attn`` point per layer whose Function saves q, k and v
(views of one fused projection's output), its output and a small row statistic, the pattern of TE's fused
attention (A's ``core_attn``). Steps with offloading on and off alternate in one process; the result is the median
paired difference per layer and microbatch. CPU copies are memcpy, so this measures the runtime's Python and
bookkeeping, not a GPU step. ``--pattern attention-set``: A's attention set, ``qkv_linear``, ``core_attn`` and
``attn_proj`` in a row (one chained group a layer). ``--paused``: the offloading steps run inside
``mcore_offload.paused()``, so the difference is what the points cost a step that offloads nothing
(``pretrain_gpt.py``'s plain steps). ``--hooks-only``: every saved tensor is under ``min_offloaded_tensor_size``,
so the points open their groups and the hooks see every tensor but nothing moves (the GPU host's ``hooks_only``).
``--stub-cuda``: the transport is the GPU's (``RawCudaTransport``: pinned-pool bookkeeping, events, fences, the C++
copy loop) over ``cpu_transport_glue.py``'s stub CUDA runtime, whose calls return at once, so the figure is the
runtime's host time on the GPU's code path less the CUDA calls themselves (needs a C compiler):

    python benchmarks/cpu_grouped_layer.py [--pattern attention] [--pairs 400] [--experts 16] [--paused | --hooks-only]
        [--stub-cuda] [--evict-mib MIB] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mcore_offload.runtime import points  # noqa: E402
from mcore_offload.runtime.manager import paused, reset  # noqa: E402
from mcore_offload.runtime.transport import transport_for  # noqa: E402
from mcore_offload.summary import get_summary  # noqa: E402

logger = logging.getLogger("cpu_grouped_layer")


def grouped_function(experts: int) -> type[torch.autograd.Function]:
    class Grouped(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *weights):
            ctx.save_for_backward(*torch.split(x, x.shape[0] // experts), *weights)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            _ = ctx.saved_tensors  # unpacks every saved tensor, as the real backward does
            return (grad * 2, *[None] * experts)

    return Grouped


class _Attention(torch.autograd.Function):
    """Saves what TE's fused attention saves: q, k, v, the output and a small per-row statistic."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q * k + v
        ctx.save_for_backward(q, k, v, out, out.sum(-1))
        return out

    @staticmethod
    def backward(ctx, grad):
        _ = ctx.saved_tensors
        return grad, grad, grad


class _Evict(torch.autograd.Function):
    """Identity whose forward and backward first write a buffer (``--evict-mib``): the caches the next layer's points
    find are as cold as after a real layer's work, in the offloading and the plain step alike."""

    @staticmethod
    def forward(ctx, x, buf):
        buf.add_(1)
        ctx.buf = buf
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.buf.add_(1)
        return grad, None


def evicting(x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
    return x if buf is None else _Evict.apply(x, buf)


class AttentionChunk(torch.nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(width, 3 * width) / width)
        self.layers = layers
        self.evict: torch.Tensor | None = None  # --evict-mib's buffer

    def forward(self, x: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
        points.begin_chunk(config, None, self)
        x = x * 1
        for _ in range(self.layers):
            x = self.layer(x, config)
        return x

    def layer(self, x: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
        x = evicting(x, self.evict)
        points.layer_boundary(config)
        qkv = x @ self.qkv
        with points.offload("core_attn", config, qkv) as h:
            out = _Attention.apply(*h.chunk(3, dim=-1))
        out = points.commit("core_attn", config, out)
        return out + x


class AttentionSetChunk(AttentionChunk):
    """A's attention set: ``qkv_linear``, ``core_attn`` and ``attn_proj`` in a row (one chained group a layer)."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__(layers, width)
        self.proj = torch.nn.Parameter(torch.randn(width, width) / width)

    def layer(self, x: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
        x = evicting(x, self.evict)
        points.layer_boundary(config)
        with points.offload("qkv_linear", config, x) as h:
            qkv = h @ self.qkv
        qkv = points.commit("qkv_linear", config, qkv)
        with points.offload("core_attn", config, qkv) as h:
            out = _Attention.apply(*h.chunk(3, dim=-1))
        out = points.commit("core_attn", config, out)
        with points.offload("attn_proj", config, out) as h:
            out = h @ self.proj
        out = points.commit("attn_proj", config, out)
        return out + x


class ExpertChunk(torch.nn.Module):
    def __init__(self, layers: int, experts: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8, 8)) for _ in range(experts))
        self.layers, self.fn = layers, grouped_function(experts)

    def forward(self, x: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
        points.begin_chunk(config, None, self)
        x = x * 1  # not the caller's tensor: the first layer's input is ours to offload
        for _ in range(self.layers):
            x = self.layer(x, config)
        return x

    def layer(self, x: torch.Tensor, config: SimpleNamespace) -> torch.Tensor:
        # a method, so that no local outlives the layer (a held tensor is not offloaded: it would free nothing)
        points.layer_boundary(config)
        with points.offload("expert_fc1", config, x) as h:
            y = self.fn.apply(h, *self.weights)
        y = points.commit("expert_fc1", config, y)
        with points.offload("moe_act", config, y) as h:
            y = self.fn.apply(h, *self.weights)
        return points.commit("moe_act", config, y)


def build_pattern(pattern: str, layers: int, experts: int) -> tuple[torch.nn.Module, torch.Tensor, list[str]]:
    """The chunk of ``pattern`` (``grouped``, ``attention`` or ``attention-set``), its input and the offload points
    it has."""
    if pattern == "grouped":
        return ExpertChunk(layers, experts), torch.randn(experts * 8, 8, requires_grad=True), ["expert_fc1",
                                                                                              "moe_act"]
    if pattern == "attention-set":
        return (AttentionSetChunk(layers, 16), torch.randn(64, 16, requires_grad=True),
                ["qkv_linear", "core_attn", "attn_proj"])
    return AttentionChunk(layers, 16), torch.randn(64, 16, requires_grad=True), ["core_attn"]


def install_stub_transport() -> None:
    """Make the CPU device's transport the GPU's raw one over the stub CUDA runtime (``--stub-cuda``)."""
    import tempfile

    import cpu_transport_glue

    from mcore_offload.runtime import transport as transport_module

    if cpu_transport_glue.compiler() is None:
        raise SystemExit("--stub-cuda needs a C compiler (cc or gcc) for the stub CUDA runtime: install one")
    rt = cpu_transport_glue.stub_runtime(Path(tempfile.mkdtemp(prefix="stub_cuda_")))
    transport_module._TRANSPORTS[torch.device("cpu")] = cpu_transport_glue.stub_transport(rt, device_index=-1,
                                                                                           native=True)


def points_config(modules: list[str], on: bool, min_size: int = 1) -> SimpleNamespace:
    """The TransformerConfig fields the offload points read."""
    return SimpleNamespace(fine_grained_activation_offloading=on, offload_modules=modules,
                           min_offloaded_tensor_size=min_size,
                           recompute_granularity=None, recompute_modules=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pattern", choices=["grouped", "attention", "attention-set"], default="grouped")
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--paused", action="store_true",
                   help="the offloading step runs inside mcore_offload.paused(): what the points cost a step that "
                        "offloads nothing (pretrain_gpt.py's plain steps)")
    p.add_argument("--hooks-only", action="store_true",
                   help="every saved tensor under min_offloaded_tensor_size (10^12 elements): the points, groups and "
                        "hooks run and nothing is moved, as issue5_host.sh's hooks_only variant on the GPU host")
    p.add_argument("--stub-cuda", action="store_true",
                   help="the GPU's transport over a stub CUDA runtime (see the module docstring)")
    p.add_argument("--evict-mib", type=float, default=0.0,
                   help="attention patterns: write a buffer of this many MiB at each layer's start in forward and "
                        "backward, in both steps of a pair, so that the points run on caches as cold as a real "
                        "layer leaves them (0: off)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("mcore_offload").setLevel(logging.WARNING)  # no per-step summary lines
    torch.set_num_threads(1)
    reset()
    if args.stub_cuda:
        install_stub_transport()
    model, x, modules = build_pattern(args.pattern, args.layers, args.experts)
    if args.evict_mib:
        if not isinstance(model, AttentionChunk):
            raise SystemExit("--evict-mib needs --pattern attention or attention-set")
        model.evict = torch.zeros(int(args.evict_mib * 2**20) // 4, dtype=torch.float32)

    def step(cfg: SimpleNamespace) -> float:
        t0 = time.perf_counter()
        with paused() if args.paused and cfg is on else contextlib.nullcontext():
            points.step_boundary(lambda: [model(x, cfg).sum().backward() for _ in range(args.microbatches)])()
        return time.perf_counter() - t0

    on, off = points_config(modules, True, 10**12 if args.hooks_only else 1), points_config(modules, False)
    warmup = max(args.pairs // 20, 1)
    diffs = []
    for i in range(args.pairs + warmup):
        if i % 2:  # the plain step first in every other pair: a step's cost can depend on what ran just before it
            t_off = step(off)
            d = step(on) - t_off
        else:
            d = step(on) - step(off)
        if i >= warmup:
            diffs.append(d)
        if (i + 1) % 100 == 0:
            logger.info("pair %d/%d", i + 1, args.pairs + warmup)
    last = get_summary().last_step
    if args.paused:
        if last is not None:
            raise SystemExit("a paused step offloaded: the benchmark measured offloading (a bug in this script)")
    elif args.hooks_only:
        # a step that moves nothing leaves no step record
        if last is not None and last.total("offloaded"):
            raise SystemExit("a hooks-only step offloaded: the benchmark measured offloading (a bug in this script)")
    elif last is None or last.total("offloaded") == 0:
        raise SystemExit("nothing was offloaded: the benchmark measured no offloading (a bug in this script)")
    else:
        logger.info("last offloading step: %d bytes offloaded, %d skipped (held elsewhere), %d kept on the device",
                    last.total("offloaded"), last.total("skipped_aliased"), last.total("kept_on_device"))
    per = statistics.median(diffs) * 1e6 / (args.layers * args.microbatches)
    transport = type(transport_for(torch.device("cpu"))).__name__  # what made the last step's copies
    mode = " (paused)" if args.paused else " (hooks only)" if args.hooks_only else ""
    evict = f", {args.evict_mib:g} MiB written a layer" if args.evict_mib else ""
    logger.info("added per layer and microbatch%s: median %.1f us (%d pairs, pattern %s, %d experts%s%s)", mode, per,
                args.pairs, args.pattern, args.experts, ", stub CUDA transport" if args.stub_cuda else "", evict)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"added_us_per_layer_microbatch": per, "transport": transport,
                                                   **vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build tiny megatron-core GPTModels on CPU and run them through the real pipeline schedules.

Typical single-process use::

    init_parallel()                          # gloo world of 1, TP=PP=1, installs the CPU shims
    chunks = build_dense_gpt(config_overrides={...})
    result = run_steps(chunks, n_steps=2, num_microbatches=2, seq_len=16, micro_batch_size=2)
    teardown_parallel()

Multi-process (PP / VPP) use goes through :mod:`tests.harness.multiproc`, which calls
:func:`init_parallel` in each worker with its rank.

megatron is imported inside the functions so that a patched megatron-core copy placed first on
``sys.path`` before the first call is the one used.
"""

from __future__ import annotations

import contextlib
import re
import socket
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from . import require_cpu_only_torch
from .cpu_shims import install_cpu_shims

DEFAULT_SEED = 1234
DEFAULT_VOCAB_SIZE = 128
DEFAULT_MAX_SEQ_LEN = 64
_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")


def find_free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_parallel(
    world_size: int = 1,
    rank: int = 0,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    port: int | None = None,
    seed: int = DEFAULT_SEED,
    timeout_s: float = 60.0,
) -> None:
    """Start a gloo process group (if none yet), then megatron's model-parallel state.

    Installs the CPU shims, creates a ``TCPStore`` on ``127.0.0.1:port`` (rank 0 hosts it; a free
    port is picked when ``world_size == 1`` and ``port`` is None), calls
    ``parallel_state.initialize_model_parallel(tp, pp, vpp, expert_model_parallel_size=ep)`` and
    seeds megatron's RNG tracker with ``model_parallel_cuda_manual_seed(seed)`` (CPU-shimmed).
    An already-initialised model-parallel state is destroyed and rebuilt.
    """
    if world_size == 1:  # the workers of run_multiprocess were checked by their parent
        require_cpu_only_torch()
    install_cpu_shims()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if port is None:
            if world_size != 1:
                raise ValueError("multi-process init_parallel needs an explicit shared port")
            port = find_free_port()
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        create_gloo_process_groups=False,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def teardown_parallel() -> None:
    """Destroy megatron's model-parallel state and the default process group (if any)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def make_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    ffn_hidden_size: int | None = None,
    moe: bool = False,
    num_experts: int = 4,
    moe_router_topk: int = 2,
    config_overrides: dict[str, Any] | None = None,
) -> Any:
    """Build a tiny fp32, dropout-free, fusion-free ``TransformerConfig`` for CPU.

    Pipeline sizes are taken from the initialised ``parallel_state``; with VPP the p2p settings
    are ``overlap_p2p_comm=True, batch_p2p_comm=False`` (see README.md). ``moe=True`` adds
    ``num_moe_experts``/``moe_router_topk``, ``moe_grouped_gemm=False`` (SequentialMLP experts),
    the allgather dispatcher (the all-to-all one creates a CUDA stream), a small aux loss and
    ``add_bias_linear=False`` (expert biases break SequentialMLP's backward, see below).
    ``config_overrides`` is applied last, as keyword arguments to ``TransformerConfig``.
    """
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    kwargs: dict[str, Any] = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "ffn_hidden_size": ffn_hidden_size if ffn_hidden_size is not None else 4 * hidden_size,
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp,
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "pipeline_dtype": torch.float32,
        "params_dtype": torch.float32,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cpu_initialization": True,
        "perform_initialization": True,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "deterministic_mode": True,
    }
    if pp > 1 and vpp is not None:
        # Megatron-LM's own default (batch_p2p_comm = not overlap_p2p_comm). The megatron-core
        # default batch_p2p_comm=True is silently wrong at PP=2 with VPP: see README.md.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if moe:
        kwargs.update(
            num_moe_experts=num_experts,
            moe_router_topk=moe_router_topk,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            # SequentialMLP experts with biases hit an in-place add on a custom-Function view
            # (transformer/mlp.py L231 `output += output_bias...`): autograd RuntimeError.
            add_bias_linear=False,
        )
    kwargs.update(config_overrides or {})
    return TransformerConfig(**kwargs)


def build_gpt_chunks(
    config: Any,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    seed: int = DEFAULT_SEED,
    position_embedding_type: str = "learned_absolute",
    share_embeddings_and_output_weights: bool = False,
    layout_independent_init: bool = True,
) -> list[torch.nn.Module]:
    """Build this rank's GPTModel chunk(s) (one per virtual stage) with the local layer spec.

    Initialisation is deterministic: the CPU generator and megatron's RNG tracker are re-seeded
    with ``seed`` before the first chunk, then chunks are built in ``vp_stage`` order (train
    mode). With ``layout_independent_init`` (default) every >=2-D weight is then overwritten by
    :func:`init_params_by_name` (std ``config.init_method_std``), so the same model comes out of
    any PP/VPP layout. Tied embeddings default to off: with PP > 1 tying calls
    ``weight.data.cuda()`` (``models/common/language_module/language_module.py`` L233).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm
    )
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_seq_len,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=stage
            ),
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            vp_stage=stage,
        )
        model.train()
        chunks.append(model)
    if layout_independent_init:
        init_params_by_name(chunks, seed, config.init_method_std)
    return chunks


def build_dense_gpt(
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    config_overrides: dict[str, Any] | None = None,
    **build_kwargs: Any,
) -> list[torch.nn.Module]:
    """Tiny dense GPTModel chunk list for this rank (``get_gpt_layer_local_spec()``).

    ``build_kwargs`` go to :func:`build_gpt_chunks` (``vocab_size``, ``max_seq_len``, ``seed``,
    ``position_embedding_type``, ...).
    """
    config = make_config(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        config_overrides=config_overrides,
    )
    return build_gpt_chunks(config, **build_kwargs)


def build_moe_gpt(
    *,
    num_layers: int = 2,
    hidden_size: int = 32,
    num_attention_heads: int = 4,
    num_experts: int = 4,
    moe_router_topk: int = 2,
    config_overrides: dict[str, Any] | None = None,
    **build_kwargs: Any,
) -> list[torch.nn.Module]:
    """Tiny MoE GPTModel chunk list (local spec, SequentialMLP experts, allgather dispatcher).

    Every layer is an MoE layer. ``build_kwargs`` go to :func:`build_gpt_chunks`.
    """
    config = make_config(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        moe=True,
        num_experts=num_experts,
        moe_router_topk=moe_router_topk,
        config_overrides=config_overrides,
    )
    return build_gpt_chunks(config, **build_kwargs)


def mock_batches(
    vocab_size: int, seq_len: int, micro_batch_size: int, seed: int = 0
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless deterministic micro-batches: random tokens, next-token labels, full loss mask."""
    gen = torch.Generator().manual_seed(seed)
    position_ids = torch.arange(seq_len).unsqueeze(0).expand(micro_batch_size, -1)
    while True:
        seq = torch.randint(0, vocab_size, (micro_batch_size, seq_len + 1), generator=gen)
        yield {
            "tokens": seq[:, :-1].contiguous(),
            "labels": seq[:, 1:].contiguous(),
            "loss_mask": torch.ones(micro_batch_size, seq_len),
            "position_ids": position_ids.contiguous(),
        }


def _loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked mean of the per-token losses (the schedule divides by num_microbatches)."""
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> Any:
    """forward_step_func for the schedules: GPTModel returns per-token losses when given labels."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


@dataclass
class RunResult:
    """Per-step outputs of :func:`run_steps`.

    ``losses[i]`` is the mean "lm loss" over step i's micro-batches (broadcast from the last
    pipeline stage, so every rank holds it). ``grads[i]`` maps parameter name to a clone of its
    ``.grad`` after step i (``None`` if the parameter got no gradient; ``grads`` stays empty for
    forward-only runs). Names are global (see
    :func:`global_param_names`): merging the dicts of all pipeline ranks gives the whole model's
    grads, keyed like a PP=1 run of the same model.
    """

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)


def global_param_names(chunk: torch.nn.Module) -> dict[str, str]:
    """Map a chunk's local parameter names to partition-independent global names.

    ``decoder.layers.{j}.`` (chunk-local index) becomes ``decoder.layers.{L}.`` with ``L`` the
    global 0-based layer index (``TransformerLayer.layer_number - 1``); other names are kept.
    Global names are unique across all chunks and ranks of one model.
    """
    decoder = getattr(chunk, "decoder", None)
    offsets = (
        {j: layer.layer_number - 1 for j, layer in enumerate(decoder.layers)} if decoder else {}
    )
    mapping = {}
    for name, _ in chunk.named_parameters():
        match = _LOCAL_LAYER.match(name)
        mapping[name] = f"decoder.layers.{offsets[int(match[1])]}.{match[2]}" if match else name
    return mapping


def named_params(model_chunks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) over all of this rank's chunks (see :func:`global_param_names`)."""
    out = []
    for chunk in model_chunks:
        names = global_param_names(chunk)
        out.extend((names[name], param) for name, param in chunk.named_parameters())
    return out


def init_params_by_name(model_chunks: list[torch.nn.Module], seed: int, std: float) -> None:
    """Re-initialise every >=2-D parameter from a generator seeded by (seed, global name).

    Values then do not depend on the PP/VPP layout, so e.g. a PP=2 run can be compared with a
    PP=1 run of the same model. 1-D parameters keep megatron's constant init (norm weights 1,
    biases 0).
    """
    with torch.no_grad():
        for name, param in named_params(model_chunks):
            if param.dim() < 2:
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * std)


def _broadcast_from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """Share a last-pipeline-stage tensor with every rank of the pipeline group."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return value
    dist.broadcast(
        value,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return value


def run_steps(
    model_chunks: list[torch.nn.Module],
    n_steps: int,
    num_microbatches: int,
    seq_len: int,
    micro_batch_size: int,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    data_seed: int = 0,
    lr: float | None = None,
    forward_only: bool = False,
) -> RunResult:
    """Run ``n_steps`` forward(+backward) steps through ``get_forward_backward_func()``.

    Each step zeroes grads (``param.grad = None``), runs the schedule over ``num_microbatches``
    mock micro-batches (every chunk gets its own iterator over the same deterministic stream,
    seeded with ``data_seed``), records the loss and cloned grads, and then, if ``lr`` is given,
    applies plain SGD ``p -= lr * p.grad`` (no optimizer object; with ``lr=None`` parameters
    never change). No DDP wrapper: ``config.no_sync_func``, ``grad_sync_func`` and
    ``finalize_model_grads_func`` stay None, so grads are plain ``.grad`` of this rank's chunks.
    ``forward_only=True`` runs the schedule under ``torch.no_grad()`` (as Megatron-LM's evaluate
    does) and records no grads. The chunks' train/eval mode is left as the caller set it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward_func = get_forward_backward_func()
    iterators = [
        mock_batches(vocab_size, seq_len, micro_batch_size, seed=data_seed) for _ in model_chunks
    ]
    data_iterator: Any = iterators if len(model_chunks) > 1 else iterators[0]
    model: Any = model_chunks if len(model_chunks) > 1 else model_chunks[0]
    params = named_params(model_chunks)
    result = RunResult()
    for _ in range(n_steps):
        for _, param in params:
            param.grad = None
        with torch.no_grad() if forward_only else contextlib.nullcontext():
            outputs = forward_backward_func(
                forward_step_func=_forward_step,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=num_microbatches,
                seq_length=seq_len,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
        if outputs:
            loss = torch.stack([out["lm loss"] for out in outputs]).mean()
        else:
            loss = torch.zeros([], dtype=torch.float32)
        result.losses.append(float(_broadcast_from_last_stage(loss)))
        if not forward_only:
            result.grads.append(
                {
                    name: None if param.grad is None else param.grad.detach().clone()
                    for name, param in params
                }
            )
        if lr is not None and not forward_only:
            with torch.no_grad():
                for _, param in params:
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-lr)
    return result

"""The model ``pretrain_gpt.py`` trains: its megatron-core ``TransformerConfig`` from Megatron-LM-style flags
(``pretrain_args.py``) and its GPT model chunks, one per virtual pipeline stage.

Benchmark tooling only: the library never imports this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build_config(args):
    """megatron-core's TransformerConfig for these flags (RMSNorm and SwiGLU with the TE spec, LayerNorm and GeLU
    with the local one, no biases)."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    te = args.transformer_impl == "transformer_engine"
    kw = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype,
        normalization="RMSNorm" if te else "LayerNorm", gated_linear_unit=te, activation_func=F.silu if te else F.gelu,
        add_bias_linear=False, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        bias_activation_fusion=te, masked_softmax_fusion=False, bias_dropout_fusion=te,
        gradient_accumulation_fusion=False, use_cpu_initialization=not torch.cuda.is_available(),
        recompute_granularity=args.recompute_granularity, recompute_modules=args.recompute_modules,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        transformer_impl=args.transformer_impl,
    )
    # only when asked: the config fields' defaults are what every run before session 57 used, and a release
    # without a field then still builds
    kw.update({k: True for k, on in (("apply_rope_fusion", args.rope_fusion),
                                     ("fused_single_qkv_rope", args.fused_single_qkv_rope)) if on})
    if args.fp8:
        kw.update(fp8=args.fp8, fp8_recipe=args.fp8_recipe)
    if args.attention_backend != "auto":
        from megatron.core.transformer.enums import AttnBackend

        kw.update(attention_backend=AttnBackend[args.attention_backend])
    if args.pipeline_model_parallel_size > 1 and args.virtual_pipeline_model_parallel_size:
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if args.num_experts:
        kw.update(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                  moe_ffn_hidden_size=args.moe_ffn_hidden_size or args.ffn_hidden_size,
                  moe_grouped_gemm=te and not args.no_moe_grouped_gemm, moe_aux_loss_coeff=1e-2,
                  moe_token_dispatcher_type=args.moe_token_dispatcher_type
                  or ("alltoall" if torch.cuda.is_available() else "allgather"))
        if args.moe_permute_fusion:
            kw.update(moe_permute_fusion=True)
    if args.fine_grained_activation_offloading:
        kw.update(fine_grained_activation_offloading=True, offload_modules=list(args.offload_modules),
                  min_offloaded_tensor_size=args.min_offloaded_tensor_size)
    return TransformerConfig(**kw)


def build_model(args, config) -> list[torch.nn.Module]:
    """The GPT model chunks of this pipeline rank (one per virtual stage), in training mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if args.transformer_impl == "transformer_engine":
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts,
            moe_grouped_gemm=bool(args.num_experts) and not args.no_moe_grouped_gemm)
    else:
        spec = specs.get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    vpp = args.virtual_pipeline_model_parallel_size
    torch.manual_seed(args.seed)
    chunks = []
    for vp in range(vpp or 1):
        stage = vp if vpp else None
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.vocab_size,
            max_sequence_length=args.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope" if args.transformer_impl == "transformer_engine"
            else "learned_absolute",
            vp_stage=stage))
    for c in chunks:
        if args.transformer_impl == "local":
            # What Megatron-LM's get_model and Float16Module do: the local spec's plain torch modules (learned
            # position table, norms) start on the CPU in fp32. The TE path is built on the device in params_dtype
            # and stays exactly as every earlier session ran it.
            if torch.cuda.is_available():
                c.cuda(torch.cuda.current_device())
            if args.bf16:
                c.bfloat16()
        c.train()
    return chunks

"""Megatron-LM command-line flags for the feature: ``--fine-grained-activation-offloading``, ``--offload-modules``
and ``--min-offloaded-tensor-size``, with upstream megatron 0.16's names, types and defaults.

Why this is all a Megatron-LM training script needs: ``pretrain(..., extra_args_provider=...)`` lets a script add
flags, and Megatron-LM's ``core_transformer_config_from_args`` copies every parsed flag whose name is a
``TransformerConfig`` field into the config. The patch adds upstream's three fields, so the three flags reach the
config unchanged and its validation (``mcore_offload.config``) judges them::

    from mcore_offload.megatron_args import add_offload_args
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_offload_args)

A script that has a provider of its own chains both: ``extra_args_provider=chain_args_providers(mine,
add_offload_args)``. Adding the flags twice is harmless (the second call adds nothing).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from mcore_offload.config import DEFAULT_MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

#: The flags, as upstream megatron 0.16's arguments.py spells them.
FLAGS: tuple[str, ...] = ("--fine-grained-activation-offloading", "--offload-modules", "--min-offloaded-tensor-size")


def add_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the three flags to ``parser`` (a Megatron-LM ``extra_args_provider``); returns ``parser``."""
    present = [flag for flag in FLAGS if flag in parser._option_string_actions]  # argparse has no public lookup
    if len(present) == len(FLAGS):
        return parser  # added before: idempotent
    if present:
        raise ValueError(f"the parser already defines {', '.join(present)} but not the other offloading flags; "
                         "add them all with add_offload_args or none.")
    group = parser.add_argument_group(title="fine-grained activation offloading (mcore-offload)")
    group.add_argument("--fine-grained-activation-offloading", action="store_true", default=False,
                       help="keep the activations saved inside --offload-modules in pinned host memory between "
                            "their forward and backward")
    group.add_argument("--offload-modules", nargs="*", type=str, default=[],
                       help=f"points to offload: any of {', '.join(OFFLOAD_MODULES)}; or 'auto' (every copy "
                            "hidden) or 'auto:<GiB>' (just enough to bring each rank's peak to that many GiB)")
    group.add_argument("--min-offloaded-tensor-size", type=int, default=DEFAULT_MIN_OFFLOADED_TENSOR_SIZE,
                       help="storages with fewer elements stay on the device (default %(default)s)")
    return parser


def chain_args_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One ``extra_args_provider`` that applies each of ``providers`` in turn (``None`` entries are skipped)."""

    def provide(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for provider in providers:
            if provider is not None:
                parser = provider(parser)
        return parser

    return provide

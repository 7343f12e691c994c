"""Benchmark-only switches that take parts of mcore_offload's offload points away, to time what each part costs
(``pretrain_gpt.py --without-pack-hooks / --without-node-hooks``, ``cpu_pipeline_host.py --without pack-hooks``).
Never for training: with a part gone, what the points would offload is not offloaded (pack hooks) or not reloaded
(node hooks)."""

from __future__ import annotations

import os


def without_pack_hooks() -> None:
    """The points' saved-tensor hooks are never pushed. Both glues (points.py and the C++ block) push and pop them
    through ``points._push_hooks`` / ``_pop_hooks``, read at each use, so replacing those leaves every other part of a
    point in place: the group, the start and commit node hooks, the commit."""
    from mcore_offload.runtime import points

    points._push_hooks = lambda pack, unpack: None
    points._pop_hooks = lambda: None


def without_node_hooks() -> None:
    """No group start or commit hook on any autograd node. ``MCORE_OFFLOAD_NODE_HOOKS=0`` (read when the manager is
    made, before the first forward) sends both glues to the identity nodes, which become plain identities here; the
    commit still queues its group. Nothing may move in such a run: no commit hook means no reload."""
    from mcore_offload.runtime import points

    os.environ["MCORE_OFFLOAD_NODE_HOOKS"] = "0"

    def commit_without_node(tensor, handler, group):
        handler.on_group_commit_forward(group)
        return tensor

    points._start = lambda tensor, handler, group: tensor
    points._commit_node = commit_without_node

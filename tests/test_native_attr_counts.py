"""The counting build of the native runtime (MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1, attr_counts.cpp): what it counts,
that reading the counts empties them, and that an Entry's fields (read directly, common.h's getattr_fast) are not
generic attribute calls; that in a pipelined step the runtime's own state classes get none (member_slots.cpp). The
ordinary build has no attr_counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mcore_offload.runtime import native

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(native.toolchain_missing() is not None, reason="needs a C++ compiler and ninja")


def test_the_ordinary_build_has_no_attr_counts(monkeypatch):
    monkeypatch.delenv("MCORE_OFFLOAD_NATIVE_COUNT_ATTRS", raising=False)
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    native.reset()
    try:
        assert not hasattr(native.load_native(), "attr_counts")
    finally:
        native.reset()


def test_the_counting_build_counts_generic_attribute_calls_and_not_an_entrys_fields():
    # its own process: the counting module is a second build of the same extension, loaded under its own name
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from mcore_offload.runtime.native import load_native
        n = load_native()
        n.attr_counts()
        # reload's first pass reads each entry's device_storage, then its host where the storage is gone
        n.reload(object(), ([SimpleNamespace(device_storage=None, host=None)],), False)
        print(sorted(n.attr_counts().items()))
        print(sorted(n.attr_counts().items()))
        entry = n.Entry("core_attn", 4, None, None)
        n.reload(object(), ([entry],), False)
        print(sorted(n.attr_counts().items()))
    """)
    env = {**os.environ, "MCORE_OFFLOAD_NATIVE_COUNT_ATTRS": "1", "MCORE_OFFLOAD_NATIVE": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, again, entry = proc.stdout.strip().splitlines()[-3:]
    assert first == str([("get types.SimpleNamespace.device_storage", 1), ("get types.SimpleNamespace.host", 1)])
    assert again == "[]"  # reading the counts emptied them
    assert entry == "[]"  # the same reads of an Entry go to its fields directly


def test_the_runtimes_own_state_is_read_from_slots_in_a_pipelined_step(tmp_path):
    # member_slots.cpp reads a slot with one load only where the class keeps the attribute in __slots__ (or is a C
    # type with members); an attribute the C++ starts reading that a class keeps in its dict, or a class default
    # that shadows a slot, would show up here as generic calls on the runtime's own classes
    out = tmp_path / "counts.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cpu_attr_counts.py"), "--layout", "pp2vpp2",
                           "--warmup", "1", "--steps", "1", "--layers", "8", "--microbatches", "4",
                           "--json-out", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(out.read_text())
    ours = ("ChunkOffloadHandler", "OffloadManager", "OffloadSummary", "Group", "Entry", "SavedRef")
    generic = {key: per for key, per in counts["by_type"] if key.split(" ", 1)[1].rsplit(".", 1)[-1] in ours}
    assert generic == {}
    assert counts["total"] > 0  # the counting build did count (the transport's events, torch's objects)
    # the direct accesses are counted apart (slot_counts()): an Entry's fields and the state classes' slots
    direct = dict(counts["slots"]["by_type"])
    assert direct.get("get mcore_offload_native.Entry", 0) > 0 and direct.get("get ChunkOffloadHandler", 0) > 0

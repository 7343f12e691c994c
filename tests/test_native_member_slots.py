"""The C++ runtime's direct slot reads and writes (runtime/native/member_slots.cpp): the same answers and errors as
getattr / setattr wherever a type, its descriptors or its attribute hooks say otherwise, and a cache that resolves a
(type, name) pair once and again after the type changes."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from mcore_offload.runtime import native
from mcore_offload.runtime.handler import ChunkOffloadHandler
from mcore_offload.runtime.manager import OffloadManager, get_manager
from mcore_offload.runtime.raw_transport import RawCudaTransport
from mcore_offload.summary import OffloadSummary


@pytest.fixture
def module(monkeypatch):
    if native.toolchain_missing():
        pytest.skip(f"the C++ runtime cannot be built here: {native.toolchain_missing()}")
    native.reset()
    monkeypatch.setenv("MCORE_OFFLOAD_NATIVE", "1")
    n = native.load_native()
    n._reset_member_slots()
    yield n
    n._reset_member_slots()
    native.reset()


class Slotted:
    __slots__ = ("a", "b")


def assert_reads_fail_alike(module, obj, name, error=AttributeError):
    """Reading ``name`` through the C++ path raises what plain getattr raises, message included."""
    with pytest.raises(error) as direct:
        getattr(obj, name)
    with pytest.raises(error) as ours:
        module._get_attr(obj, name)
    assert str(ours.value) == str(direct.value)


def test_a_slot_is_read_and_written_directly_after_one_lookup_of_its_type(module):
    obj = Slotted()
    obj.a = 1
    assert module._get_attr(obj, "a") == 1
    assert module._member_slot_lookups() == 1
    module._set_attr(obj, "a", [2])
    assert obj.a == [2] and module._get_attr(obj, "a") == [2]
    other = Slotted()
    other.a = "x"
    assert module._get_attr(other, "a") == "x"
    assert module._member_slot_lookups() == 1  # the same (type, name): no second lookup
    module._reset_member_slots()
    assert module._member_slot_lookups() == 0
    assert module._get_attr(obj, "a") == [2] and module._member_slot_lookups() == 1


def test_an_unset_slot_and_a_missing_name_raise_what_getattr_raises(module):
    obj = Slotted()
    assert_reads_fail_alike(module, obj, "b")
    assert_reads_fail_alike(module, obj, "nope")
    with pytest.raises(AttributeError):
        module._set_attr(obj, "nope", 1)  # no __dict__ to put it in


def test_a_class_changed_after_the_lookup_is_looked_up_again(module):
    class Changing:
        __slots__ = ("a",)

    obj = Changing()
    obj.a = 1
    assert module._get_attr(obj, "a") == 1
    slot = Changing.__dict__["a"]
    Changing.a = property(lambda self: 42)  # a new descriptor: the type's version tag changes
    assert module._get_attr(obj, "a") == 42
    assert module._member_slot_lookups() == 2
    Changing.a = slot
    assert module._get_attr(obj, "a") == 1


def test_attribute_hooks_of_a_subclass_take_the_generic_path(module):
    class Reading(Slotted):
        __slots__ = ()

        def __getattribute__(self, name):
            return "hooked" if name == "a" else object.__getattribute__(self, name)

    class Writing(Slotted):
        __slots__ = ()

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value * 2)

    r = Reading()
    object.__setattr__(r, "a", 1)
    assert module._get_attr(r, "a") == "hooked"
    w = Writing()
    module._set_attr(w, "a", 3)
    assert object.__getattribute__(w, "a") == 6


def test_a_slot_descriptor_on_an_unrelated_class_is_not_read_as_a_slot(module):
    class Unrelated:
        pass

    Unrelated.a = Slotted.__dict__["a"]
    assert_reads_fail_alike(module, Unrelated(), "a", TypeError)


def test_read_only_members_are_read_directly_and_written_through_the_generic_path(module):
    entry = module.Entry("core_attn", 4, None, None)
    assert module._get_attr(entry, "h2d_event") is None  # a T_OBJECT member: unset reads as None
    module._set_attr(entry, "h2d_event", "e")
    assert entry.h2d_event == "e"
    clock = module.RuntimeClock()  # its ns is a READONLY T_LONGLONG member: not an object slot
    assert module._get_attr(clock, "ns") == 0
    with pytest.raises(AttributeError):
        module._set_attr(clock, "ns", 5)


def test_plain_objects_and_modules_answer_as_getattr_does(module, monkeypatch):
    ns = types.SimpleNamespace(a=1)
    assert module._get_attr(ns, "a") == 1
    module._set_attr(ns, "a", 2)
    assert ns.a == 2
    this = sys.modules[__name__]
    assert module._get_attr(this, "Slotted") is Slotted
    monkeypatch.setattr(this, "Slotted", int)
    assert module._get_attr(this, "Slotted") is int
    assert module._get_attr(this, "__name__") == __name__
    with pytest.raises(AttributeError):
        module._get_attr(this, "no_such_global")


def test_the_state_the_cpp_runtime_touches_is_held_in_slots(module):
    # what member_slots.cpp makes one load: the classes' slots must cover the names the C++ reads most
    handler = ChunkOffloadHandler(get_manager(), None, 0, torch.device("cpu"), 4, set())
    for name in ("enabled_points", "finished", "config", "manager", "summary", "live", "groups"):
        assert type(getattr(ChunkOffloadHandler, name)).__name__ == "member_descriptor", name
        assert module._get_attr(handler, name) is getattr(handler, name)
    for name in ("summary", "forward_handler", "auto", "open_groups", "chain"):
        assert type(getattr(OffloadManager, name)).__name__ == "member_descriptor", name
    for name in ("native_clock", "_current", "off_device_bytes"):
        assert type(getattr(OffloadSummary, name)).__name__ == "member_descriptor", name
    for name in ("rt", "reload_seq", "telemetry", "_held", "pool"):
        assert type(getattr(RawCudaTransport, name)).__name__ == "member_descriptor", name
    handler.some_other_attribute = 1  # the rest still lives in the instance dict
    assert module._get_attr(handler, "some_other_attribute") == 1


def test_an_entrys_fields_are_read_and_written_without_the_table_and_as_getattr_does(module):
    entry = module.Entry("core_attn", 4, "host", "event", 7)
    names = [d for d, v in vars(type(entry)).items() if type(v).__name__ == "member_descriptor"]
    assert len(names) == 15  # every field of the struct, each readable through the direct path
    for name in names:
        assert module._get_attr(entry, name) is getattr(entry, name), name
        marker = object()
        module._set_attr(entry, name, marker)
        assert getattr(entry, name) is marker, name
    assert module._member_slot_lookups() == 0  # none went through the (type, name) table
    assert_reads_fail_alike(module, entry, "no_such_field")
    with pytest.raises(AttributeError):
        module._set_attr(entry, "no_such_field", 1)  # no instance dict
    with pytest.raises(TypeError):
        type(entry).host = property(lambda self: 0)  # why the direct path is exact: the type cannot change

"""benchmarks/cpu_cache_misses.py's reading of callgrind's cache-simulator output (no valgrind needed)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cpu_cache_misses  # noqa: E402

HEADER = "version: 1\ncreator: test\nevents: Ir Dr D1mr D1mw DLmr DLmw ILmr\n"


def _profile(path: Path, outer_misses: int, libpython_misses: int) -> Path:
    """One of our functions (its own cost, a call into libpython, a call to our helper), the helper (a call into
    the stub CUDA runtime, with a missing trailing column) and a libpython function calling back into ours."""
    path.write_text(
        HEADER
        + "ob=(1) /tmp/x/mcore_offload_hooks_0123456789ab.so\nfl=(1) ???\nfn=(1) mco::outer\n"
        + f"16 100 40 6 2 {outer_misses} 1 1\n"
        + "cob=(2) /usr/lib/libpython3.11.so.1.0\ncfi=(2) ???\ncfn=(2) PyObject_GetAttr\ncalls=3 0\n"
        + f"+1 700 300 20 0 {libpython_misses} 0 0\n"
        + "cfn=(3) mco::helper\ncalls=1 0\n* 90 10 1 1 1 1 0\n"
        + "fn=(3)\n20 40 8 0 0 0 0 0\n"
        + "cob=(3) /tmp/s/libstubcudart_copy.so\ncfi=(2)\ncfn=(4) cudaMemcpyAsync\ncalls=2 0\n21 50 20 4 4 3\n"
        + "ob=(2)\nfl=(2)\nfn=(2)\n5 1000 400 30 3 12 2 0\n"
        + "cob=(1)\ncfi=(1)\ncfn=(3)\ncalls=1 0\n6 90 10 1 1 1 1 0\n"
        + "totals: 0\n")
    return path


def test_read_profile_splits_own_costs_from_the_calls_that_leave_our_module(tmp_path):
    prof = cpu_cache_misses.read_profile(_profile(tmp_path / "on.cg", 5, 9))
    assert prof["events"] == ["Ir", "Dr", "D1mr", "D1mw", "DLmr", "DLmw", "ILmr"]
    ours = "mcore_offload_hooks_0123456789ab.so"
    assert prof["self"][(ours, "mco::outer")] == [100, 40, 6, 2, 5, 1, 1]
    assert prof["self"][(ours, "mco::helper")] == [40, 8, 0, 0, 0, 0, 0]
    assert prof["self"][("libpython3.11.so.1.0", "PyObject_GetAttr")] == [1000, 400, 30, 3, 12, 2, 0]
    # the call into libpython and the helper's into the stub (its last columns zero); not outer -> helper (both ours),
    # nor libpython -> helper (a call into ours)
    assert prof["boundary"] == {("mco::outer", "libpython3.11.so.1.0"): [700, 300, 20, 0, 9, 0, 0],
                                ("mco::helper", "libstubcudart_copy.so"): [50, 20, 4, 4, 3, 0, 0]}


def test_summarize_reports_what_the_on_step_adds_per_layer_microbatch(tmp_path):
    on = cpu_cache_misses.read_profile(_profile(tmp_path / "on.cg", 25, 49))
    off = cpu_cache_misses.read_profile(_profile(tmp_path / "off.cg", 5, 9))
    res = cpu_cache_misses.summarize(on, off, per=4)
    # outer's own L2 misses (DLmr + DLmw + ILmr) 27 against 7: 5 a layer-microbatch; its object named without the hash
    assert res["added_by_object"]["mcore_offload_hooks.so"] == {"instructions": 0, "l1d_misses": 0, "l2_misses": 5}
    assert res["added_by_object"]["libpython3.11.so.1.0"]["l2_misses"] == 0
    top = next(iter(res["top_functions_by_l2_misses"]))
    assert top == "mco::outer [mcore_offload_hooks.so]"
    # inside our calls: own (outer 27, helper 0) + leaving (libpython 49, the stub 3) = 79 on; 7 + 9 + 3 = 19 off
    assert res["inside_our_module"]["on"]["l2_misses"] == 79 / 4
    assert res["inside_our_module"]["off"]["l2_misses"] == 19 / 4
    # without the stub's copies (memcpy here, a DMA engine on the GPU host): 76 and 16
    assert res["inside_our_module_without_the_stub_copies"]["on"]["l2_misses"] == 76 / 4
    assert res["inside_our_module_without_the_stub_copies"]["off"]["l2_misses"] == 16 / 4
    assert res["inside_our_module"]["on"]["instructions"] == (100 + 40 + 700 + 50) / 4


def test_from_dir_reports_kept_profiles_without_running_callgrind(tmp_path, capsys):
    import json

    _profile(tmp_path / "on.callgrind", 25, 49)
    _profile(tmp_path / "off.callgrind", 5, 9)
    out = tmp_path / "r.json"
    assert cpu_cache_misses.main(["--from-dir", str(tmp_path), "--layers", "2", "--microbatches", "2",
                                  "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["per"] == "layer-microbatch" and "from_dir" not in res["args"]
    assert res["inside_our_module"]["on"]["l2_misses"] == 79 / 4
    assert "mco::outer [mcore_offload_hooks.so]" in capsys.readouterr().out

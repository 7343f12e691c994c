"""``mcore-offload patch``: exact, all-or-nothing, idempotent, byte-exact revert, clear refusals."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_offload.cli import main
from mcore_offload.patching import tooling
from mcore_offload.patching.tooling import PatchError, PatchState


def touched_files(version: str) -> list[str]:
    names = []
    for patch in tooling.patch_files(version):
        names += re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)
    return sorted(set(names))


def hashes(root: Path, version: str) -> dict[str, str]:
    return {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in touched_files(version)}


def test_every_patch_applies_cleanly_to_the_release(megatron_copy):
    states = tooling.check_patches(megatron_copy)
    assert states and set(states.values()) == {PatchState.NOT_APPLIED}


def test_apply_check_revert_restores_identical_bytes(megatron_copy):
    before = hashes(megatron_copy.root, megatron_copy.version)
    applied = tooling.apply_patches(megatron_copy)
    assert applied == [p.name for p in tooling.patch_files(megatron_copy.version)]
    after_apply = hashes(megatron_copy.root, megatron_copy.version)
    assert all(after_apply[f] != before[f] for f in before)  # every touched file really changed
    assert set(tooling.check_patches(megatron_copy).values()) == {PatchState.APPLIED}
    assert tooling.revert_patches(megatron_copy)
    assert hashes(megatron_copy.root, megatron_copy.version) == before
    assert set(tooling.check_patches(megatron_copy).values()) == {PatchState.NOT_APPLIED}


def test_second_apply_is_a_noop(megatron_copy, capsys):
    tooling.apply_patches(megatron_copy)
    once = hashes(megatron_copy.root, megatron_copy.version)
    assert tooling.apply_patches(megatron_copy) == []
    assert hashes(megatron_copy.root, megatron_copy.version) == once
    assert main(["patch", "apply", "--megatron-path", str(megatron_copy.root)]) == 0
    assert "already patched" in capsys.readouterr().out


def test_partially_applied_tree_is_completed(megatron_copy):
    first = tooling.patch_files(megatron_copy.version)[0]
    subprocess.run(["git", "apply", "-p1", str(first)], cwd=megatron_copy.root, check=True)
    done = tooling.apply_patches(megatron_copy)
    assert first.name not in done and len(done) == len(tooling.patch_files(megatron_copy.version)) - 1
    assert set(tooling.check_patches(megatron_copy).values()) == {PatchState.APPLIED}


def test_apply_refuses_a_modified_target_and_changes_nothing(megatron_copy):
    target = megatron_copy.core / "transformer" / "attention.py"
    text = target.read_text()
    # Edit a line inside a hunk's context, as a user's local change would.
    edited = text.replace("nvtx_range_push(suffix=\"linear_proj\")",
                          "nvtx_range_push(suffix=\"linear_proj_local_edit\")", 1)
    assert edited != text
    target.write_text(edited)
    before = hashes(megatron_copy.root, megatron_copy.version)
    with pytest.raises(PatchError, match="03-attention-points.patch.*No file was changed"):
        tooling.apply_patches(megatron_copy)
    assert hashes(megatron_copy.root, megatron_copy.version) == before
    assert tooling.check_patches(megatron_copy)["03-attention-points.patch"] is PatchState.CONFLICT
    assert main(["patch", "check", "--megatron-path", str(megatron_copy.root)]) == 1


def test_unsupported_version_is_refused_with_supported_list(megatron_copy, capsys):
    info = megatron_copy.core / "package_info.py"
    info.write_text(re.sub(r"^MINOR = \d+", "MINOR = 14", info.read_text(), flags=re.M))
    install = tooling.find_megatron(megatron_copy.root)
    assert install.version == "0.14." + megatron_copy.version.split(".")[2]
    with pytest.raises(PatchError, match=rf"megatron-core {re.escape(install.version)} is not supported.*0\.15\.3"):
        tooling.check_patches(install)
    assert main(["patch", "status", "--megatron-path", str(megatron_copy.root)]) == 2
    assert "not supported" in capsys.readouterr().err


def test_earlier_015_releases_take_0153s_patches_and_say_so(megatron_copy, capsys):
    # The copy is 0.15.3 relabelled: the files our diffs touch are identical in 0.15.0-0.15.2 (SAME_PATCHES_AS's
    # comment); .ci/other-releases.sh runs the same path on the real wheels.
    assert tooling.supported_versions() == ["0.15.0", "0.15.1", "0.15.2", "0.15.3"]
    info = megatron_copy.core / "package_info.py"
    info.write_text(re.sub(r"^PATCH = \d+", "PATCH = 1", info.read_text(), flags=re.M))
    install = tooling.find_megatron(megatron_copy.root)
    assert install.version == "0.15.1" and tooling.patch_source("0.15.1") == "0.15.3"
    before = hashes(install.root, install.version)
    assert main(["patch", "apply", "--megatron-path", str(install.root)]) == 0
    assert "megatron-core 0.15.1" in capsys.readouterr().out
    assert set(tooling.check_patches(install).values()) == {PatchState.APPLIED}
    assert main(["patch", "status", "--megatron-path", str(install.root)]) == 0
    assert "taking 0.15.3's patches" in capsys.readouterr().out
    assert tooling.revert_patches(install)
    assert hashes(install.root, install.version) == before
    assert tooling.patch_source("0.15.3") == "0.15.3" and tooling.patch_source("0.15.4") == "0.15.4"
    with pytest.raises(PatchError, match=r"megatron-core 0\.15\.4 is not supported.*0\.15\.0, 0\.15\.1"):
        tooling.patch_files("0.15.4")


def test_path_forms_and_missing_megatron(megatron_copy, tmp_path):
    for form in (megatron_copy.root, megatron_copy.root / "megatron", megatron_copy.core):
        assert tooling.find_megatron(form).root == megatron_copy.root
    with pytest.raises(PatchError, match="--megatron-path"):
        tooling.find_megatron(tmp_path / "nowhere")


def test_status_lists_every_patch(megatron_copy, capsys):
    assert main(["patch", "status", "--megatron-path", str(megatron_copy.root)]) == 0
    out = capsys.readouterr().out
    assert f"megatron-core {megatron_copy.version}" in out
    for p in tooling.patch_files("0.15.3"):
        assert f"{p.name}: applies cleanly" in out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "mcore_offload", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "patch" in out

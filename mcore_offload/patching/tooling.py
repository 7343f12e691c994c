"""Find an installed megatron-core and apply, check or revert our unified diffs with the ``git apply`` binary.

``git apply`` is exact (context must match, no fuzz) and atomic within one invocation (if any hunk of any
patch fails, no file is written), which gives the all-or-nothing behaviour for free. We never parse diffs
ourselves.
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PATCH_ROOT = Path(__file__).resolve().parent.parent / "patch_files"

#: Releases that take another release's diffs because every file those diffs touch is byte-identical in both.
#: 0.15.0, 0.15.1 and 0.15.2 differ from 0.15.3 only in megatron_fsdp's sources, quantization/quant_config.py (a YAML
#: loader), package_info.py and the datasets' compiled helper (the released cp311 wheels compared file by file,
#: session 55): none is a file we patch or a module the runtime imports. ``git apply`` still checks every hunk's
#: context, so a release that drifted would show as a conflict, never as a half-applied patch.
SAME_PATCHES_AS: dict[str, str] = {"0.15.0": "0.15.3", "0.15.1": "0.15.3", "0.15.2": "0.15.3"}


class PatchError(RuntimeError):
    """A patch operation was refused; the message says what to do."""


class PatchState(str, enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "applies cleanly"
    CONFLICT = "conflicts"


@dataclass(frozen=True)
class MegatronInstall:
    root: Path  # the directory that contains ``megatron/core``
    version: str

    @property
    def core(self) -> Path:
        return self.root / "megatron" / "core"


def supported_versions() -> list[str]:
    """The megatron-core versions we ship patches for, those that take another release's included."""
    if not PATCH_ROOT.is_dir():
        return []
    shipped = {
        p.name.removeprefix("megatron-core-")
        for p in PATCH_ROOT.iterdir()
        if p.is_dir() and p.name.startswith("megatron-core-")
    }
    shipped |= {version for version, source in SAME_PATCHES_AS.items() if source in shipped}
    return sorted(shipped, key=lambda v: tuple(int(part) for part in v.split(".")))


def patch_source(version: str) -> str:
    """The release whose diffs ``version`` takes (itself unless listed in ``SAME_PATCHES_AS``)."""
    return SAME_PATCHES_AS.get(version, version)


def _read_version(root: Path) -> str:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise PatchError(f"{root} holds no megatron/core/package_info.py; pass the directory that "
                         "contains 'megatron/core' with --megatron-path.")
    text = info.read_text()
    parts = {}
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if not m:
            raise PatchError(f"cannot read {key} from {info}; is this a megatron-core release?")
        parts[key] = m.group(1)
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def find_megatron(path: str | os.PathLike | None = None) -> MegatronInstall:
    """Locate megatron-core: ``path`` may name the install root, ``megatron/`` or ``megatron/core``."""
    if path is None:
        spec = importlib.util.find_spec("megatron.core")
        if spec is None or not spec.submodule_search_locations:
            raise PatchError("megatron-core is not installed in this environment; "
                             "pip install 'megatron-core>=0.15.0,<0.16' or pass --megatron-path DIR.")
        root = Path(next(iter(spec.submodule_search_locations))).resolve().parent.parent
    else:
        root = Path(path).resolve()
        if (root / "core" / "package_info.py").is_file() and root.name == "megatron":
            root = root.parent
        elif (root / "package_info.py").is_file() and root.name == "core":
            root = root.parent.parent
    return MegatronInstall(root=root, version=_read_version(root))


def patch_files(version: str) -> list[Path]:
    """Our diffs for ``version``, in application order; raise if the version is unsupported."""
    directory = _patch_dir(version)
    if not directory.is_dir():
        supported = ", ".join(supported_versions()) or "none"
        raise PatchError(f"megatron-core {version} is not supported (patches exist for: {supported}); "
                         "install a supported version, e.g. pip install 'megatron-core==0.15.3'.")
    return sorted(directory.glob("*.patch"))


def _patch_dir(version: str) -> Path:
    return PATCH_ROOT / f"megatron-core-{patch_source(version)}"


def _git() -> str:
    git = shutil.which("git")
    if git is None:
        raise PatchError("the 'git' binary is needed to apply patches; install git and retry.")
    return git


def _git_apply(root: Path, patches: list[Path], *, reverse: bool = False, check: bool = False):
    cmd = [_git(), "apply", "-p1", "--whitespace=nowarn"]
    if reverse:
        cmd.append("-R")
    if check:
        cmd.append("--check")
    cmd += [str(p) for p in patches]
    env = dict(os.environ)
    # Never let git discover a repository *above* the megatron root: inside a repo's subdirectory
    # `git apply` silently skips paths outside it.
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)


def check_patches(install: MegatronInstall) -> dict[str, PatchState]:
    """State of every patch for ``install``: applied, applies cleanly, or conflicts."""
    states: dict[str, PatchState] = {}
    for patch in patch_files(install.version):
        if _git_apply(install.root, [patch], reverse=True, check=True).returncode == 0:
            states[patch.name] = PatchState.APPLIED
        elif _git_apply(install.root, [patch], check=True).returncode == 0:
            states[patch.name] = PatchState.NOT_APPLIED
        else:
            states[patch.name] = PatchState.CONFLICT
    return states


def _refuse_conflicts(install: MegatronInstall, states: dict[str, PatchState], verb: str) -> None:
    bad = [name for name, s in states.items() if s is PatchState.CONFLICT]
    if bad:
        raise PatchError(
            f"cannot {verb}: {', '.join(bad)} do(es) not match the files under {install.core} "
            "(edited by hand or another patch); reinstall megatron-core "
            f"{install.version} and retry. No file was changed."
        )


def apply_patches(install: MegatronInstall) -> list[str]:
    """Apply every patch not yet applied, all or nothing; return the names newly applied."""
    states = check_patches(install)
    _refuse_conflicts(install, states, "apply")
    todo = [_patch_dir(install.version) / n
            for n, s in states.items() if s is PatchState.NOT_APPLIED]
    if not todo:
        return []
    result = _git_apply(install.root, todo)
    if result.returncode != 0:
        raise PatchError(f"git apply failed, no file was changed: {result.stderr.strip()}")
    logger.info("applied %d patch(es) to %s", len(todo), install.core)
    return [p.name for p in todo]


def revert_patches(install: MegatronInstall) -> list[str]:
    """Reverse every applied patch, all or nothing; return the names reverted."""
    states = check_patches(install)
    _refuse_conflicts(install, states, "revert")
    todo = [_patch_dir(install.version) / n
            for n, s in reversed(list(states.items())) if s is PatchState.APPLIED]
    if not todo:
        return []
    result = _git_apply(install.root, todo, reverse=True)
    if result.returncode != 0:
        raise PatchError(f"git apply -R failed, no file was changed: {result.stderr.strip()}")
    logger.info("reverted %d patch(es) in %s", len(todo), install.core)
    return [p.name for p in todo]

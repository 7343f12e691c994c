"""The runtime's per-tensor and per-storage steps in C++ (``hooks.cpp``: the saved-tensor hooks, with
``saved_ref.cpp``: what they save; ``copy_path.cpp``, ``held_checks.cpp`` and ``entry.cpp``: the copy-out;
``copy_calls.cpp``: the transport's copy loop and reload allocations; ``bursts.cpp``: the raw transport's copy bursts
whole, with ``pool_calls.cpp`` (the pool's common answers) and ``burst_clock.cpp`` (their phase clock); ``reload.cpp``:
the reload's bookkeeping; ``backward.cpp``: a group's backward (its reload, wait and prefetch, its end);
``finish_release.cpp``: the chunk's finish; ``node_hooks.cpp``: the group hooks on autograd nodes; ``points_block.cpp``:
the offload points' forward glue; ``layer_boundary.cpp``: a layer's start; ``link_calls.cpp``: the telemetry's marks and
spans, the done events and the reload waits; ``event_type.cpp``: the pooled events; ``summary_calls.cpp`` and
``manager_calls.cpp``: the counters and the manager's bookkeeping those paths report to; ``member_slots.cpp``: attribute
reads and writes straight to a slot; ``module.cpp``: the module and what they share), built on first use with PyTorch's
extension builder, as one translation unit (:func:`unity_source`).

Why: in a launch-bound step (config A on an H100) the runtime's host time is step time, and some of its steps run once
per saved tensor or per storage: the pack and unpack hooks (6.8 and 6.7 µs each in Python, 1,856 calls per step in
session 18's breakdown of A's attention set), the copy-out (grouping by storage, alias checks, one entry and release
callback per storage, per-view bookkeeping: about 200 µs of Python per burst of about ten storages in session 20's
breakdown), the per-copy loop, the reload's allocations and its per-entry bookkeeping. The C++ versions do the same
checks and the same work without a Python frame, and hand every uncommon case (tensor subclasses, other layouts, a
storage not back yet) to the Python code, so both paths decide alike; ``tests/test_native_hooks.py`` and
``tests/test_native_copy_out.py`` check that they do.

``MCORE_OFFLOAD_NATIVE``:

- ``auto`` (default): build (once per source, torch and Python version; 20-25 s) or load the cached build; where
  that fails (no C++ compiler, no ``ninja``), log why once and keep the Python hooks;
- ``1``: the same, but a failed build raises;
- ``0``: the Python hooks.

The build goes to ``MCORE_OFFLOAD_CACHE_DIR`` (default ``~/.cache/mcore_offload``); ranks that start at once take
turns on a kernel lock (one compiles, the others then load its build). ``python -m mcore_offload build-native``
builds ahead of a run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from mcore_offload.config import choice_env

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("module.cpp", "hooks.cpp", "saved_ref.cpp", "copy_path.cpp", "held_checks.cpp",
                             "copy_calls.cpp", "bursts.cpp", "pool_calls.cpp", "burst_clock.cpp", "entry.cpp",
                             "reload.cpp", "backward.cpp", "finish_release.cpp", "node_hooks.cpp", "points_block.cpp",
                             "link_calls.cpp", "summary_calls.cpp", "event_type.cpp", "layer_boundary.cpp",
                             "manager_calls.cpp", "attr_counts.cpp", "member_slots.cpp"))
HEADERS = (Path(__file__).with_name("common.h"),)
MODES = ("auto", "0", "1")

_state: dict[str, ModuleType | None] = {}  # "module": the loaded module or None (tried and failed); reset()


def native_mode() -> str:
    return choice_env("MCORE_OFFLOAD_NATIVE", "auto", MODES,
                      "one of auto (C++ hooks where they build), 1 (C++ hooks, or fail) and 0 (Python hooks); "
                      "unset it for auto")


def cache_dir() -> Path:
    explicit = os.environ.get("MCORE_OFFLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mcore_offload"


def toolchain_missing() -> str | None:
    """What the build needs and this machine lacks (None: a C++ compiler and ninja are there)."""
    import shutil

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if shutil.which("ninja") is None:
        return "no ninja on PATH"
    return None


def counting_build() -> bool:
    """``MCORE_OFFLOAD_NATIVE_COUNT_ATTRS=1``: a benchmark build that counts the runtime's generic attribute reads and
    writes (``attr_counts()``; ``benchmarks/cpu_attr_counts.py``), cached under its own name. Slower: not for
    training."""
    return os.environ.get("MCORE_OFFLOAD_NATIVE_COUNT_ATTRS", "0") == "1"


def build_name() -> str:
    """The extension's name: one per source text, torch version and Python version (a rebuild when any changes)."""
    key = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        key.update(path.read_bytes())
    key.update(f"{torch.__version__}|{sys.version_info[:2]}|{sys.platform}".encode())
    if counting_build():
        key.update(b"|count-attrs")
    return f"mcore_offload_hooks_{key.hexdigest()[:12]}"


def unity_source(directory: Path) -> Path:
    """``directory``/all_sources.cpp: one file that includes every source, the one the builder compiles.

    Why: each source parses PyTorch's and Python's headers, about 20 s of a 2-core machine's compiler per file and
    2.5 minutes for the twenty of session 51; the sources' own code takes a few seconds. One translation unit parses
    the headers once: 20-25 s (session 51: 20 s on the 2-core machine, 22.5 s on the GPU host), for the first run on
    a machine and for each of CI's builds. The sources therefore share one anonymous namespace: a name defined in
    two of them fails to compile, so shared names live in ``module.cpp`` / ``common.h``. Rewritten only when its
    text changes: a newer file would make ninja compile again."""
    path = directory / "all_sources.cpp"
    text = "// generated by mcore_offload.runtime.native.unity_source: every source, one translation unit\n" + "".join(
        f'#include "{source}"\n' for source in SOURCES)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def build(verbose: bool = False) -> ModuleType:
    """Compile (or load the cached) extension and initialise it; raises whatever the builder raises."""
    from torch.utils.cpp_extension import load

    name = build_name()
    directory = cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    with _exclusive(directory):
        # PyTorch's builder takes a lock file here even to load a finished build and waits for it without end; no
        # other process is inside this block, so one found now was left by a build that was killed
        baton = directory / "lock"
        if baton.exists():
            logger.warning("mcore-offload: removing %s, left by a build that did not finish", baton)
            baton.unlink(missing_ok=True)
        if not any(directory.glob(f"{name}*.so")):
            logger.info("mcore-offload: compiling the C++ saved-tensor hooks into %s (once; about 30 s)", directory)
        module = load(name=name, sources=[str(unity_source(directory))], build_directory=str(directory),
                      extra_cflags=["-O2", *(["-DMCO_COUNT_ATTRS"] if counting_build() else [])], verbose=verbose)
    module.init(torch.Tensor, torch.nn.Parameter)
    return module


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """One process at a time (torchrun starts every rank at once): an advisory lock the kernel drops when its holder
    exits, so a killed build never blocks the next one."""
    try:
        import fcntl
    except ImportError:  # not POSIX: PyTorch's own lock file only
        yield
        return
    with open(directory / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_native() -> ModuleType | None:
    """The C++ hooks, or None where ``MCORE_OFFLOAD_NATIVE`` is 0 or (``auto``) they cannot be built here."""
    mode = native_mode()
    if mode == "0":
        return None
    if "module" in _state:
        module = _state["module"]
        if module is None and mode == "1":
            raise RuntimeError("MCORE_OFFLOAD_NATIVE=1 but the C++ hooks failed to build in this process; see the "
                               "first error, or set MCORE_OFFLOAD_NATIVE=auto to fall back to the Python hooks")
        return module
    try:
        module = build()
    except Exception as exc:  # the builder raises a variety: compiler, ninja, import errors
        _state["module"] = None
        if mode == "1":
            raise RuntimeError(f"MCORE_OFFLOAD_NATIVE=1 but the C++ hooks did not build ({exc}); install a C++ "
                               "compiler and ninja, or set MCORE_OFFLOAD_NATIVE=auto to fall back to the Python "
                               "hooks") from exc
        logger.warning("mcore-offload: the C++ saved-tensor hooks did not build (%s); using the Python hooks "
                       "(set MCORE_OFFLOAD_NATIVE=0 to skip this attempt)", str(exc).splitlines()[0] if str(exc)
                       else type(exc).__name__)
        return None
    _state["module"] = module
    return module


def reset() -> None:
    """Forget the load attempt (tests switch ``MCORE_OFFLOAD_NATIVE``); a built module stays importable."""
    _state.clear()

"""polyvec's native CPU kernels, compiled once per environment and loaded from a cache after that.

`csrc/varlen_attention.cpp` is bidirectional attention straight over the packed `qkv` projection (see its
header comment): no padded grid, no mask, each (sequence, head) on its own. `csrc/dynamic_quant.cpp` holds the
per-token quantize / dequantize passes around oneDNN's int8 matmul (`quantization="int8"`), and
`csrc/layer_norm.cpp` a one-read LayerNorm (layers/layernorm.py), `csrc/amx_linear.cpp` the bf16 projections of
small batches on AMX (layers/linear.py), `csrc/rope.cpp` rotary positions applied in place to a fused qkv
(models/modernbert.py), with the helpers they share in `csrc/cpu_common.h`.

They are built with PyTorch's extension loader (a C++ compiler and ninja), for the vector width PyTorch itself
uses here (AVX-512 or AVX2), into `$POLYVEC_CACHE/kernels/` (default `~/.cache/polyvec/kernels`). The
library's name carries a key of everything that makes a build fit an environment: the sources, the torch
version and build, the compiler flags, the Python ABI and the machine, so two environments on one machine
never rebuild each other's. One process builds at a time, under an `fcntl.flock` that the kernel releases when
its holder dies; each build runs in a fresh folder and the finished library is moved into place atomically,
so a build killed at any point leaves nothing that a later start waits on or loads. Where they cannot be built
(no compiler or ninja, another CPU architecture), attention falls back to PyTorch's SDPA over a padded grid,
with a warning saying why, and `quantization="int8"` is refused. Whether they are used at all is the CPU
platform's choice (`KernelOptions`, platforms/cpu.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..cache import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / name
    for name in ("varlen_attention.cpp", "dynamic_quant.cpp", "layer_norm.cpp", "amx_linear.cpp", "rope.cpp")
]
_OPS = ("varlen_attention", "quantize_rows", "layer_norm", "amx_linear", "rope_")
# PyTorch's vector classes are header-only; these select the width they compile to (as ATen's own builds do).
_ISA_FLAGS = {
    "AVX512": [
        "-DCPU_CAPABILITY_AVX512",
        "-DCPU_CAPABILITY=AVX512",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
    ],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"],
}
_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# Floats per vector register in the build: head_dim must be a multiple of it.
VECTOR_WIDTH = {"AVX512": 16, "AVX2": 8}

_lock = threading.Lock()
_state: dict[str, object] = {}


def _capability() -> str:
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older PyTorch
        return "DEFAULT"
    return "AVX512" if cap.startswith("AVX512") else cap


def build_key(cap: str) -> str:
    """Of every file under csrc/ (headers too: the loader tracks listed sources only) and of the environment
    the library is built for."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    env = (
        torch.__version__,
        torch.version.git_version,
        str(torch.version.cuda),
        str(torch._C._GLIBCXX_USE_CXX11_ABI),
        sys.implementation.cache_tag,
        platform.machine(),
        *_CFLAGS,
        *_ISA_FLAGS.get(cap, []),
        *_LDFLAGS,
    )
    digest.update("\0".join(env).encode())
    return digest.hexdigest()[:16]


def library_path(cap: str | None = None) -> Path:
    """Where this environment's built kernels live (whether or not they are built yet)."""
    cap = cap or _capability()
    name = f"polyvec_kernels_{cap.lower()}_{build_key(cap)}"
    return cache_dir() / "kernels" / name / f"{name}.so"


def _missing_tool() -> str | None:
    """The build tool that is not there (the compiler PyTorch's loader calls, or ninja), else None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"C++ compiler {cxx!r} (install g++ or clang, or set CXX)"
    try:  # the `ninja` wheel's binary, also when its venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    if shutil.which("ninja") is None:
        return "ninja (pip install ninja)"
    return None


FAILED = "build-failed.log"
"""Beside a library whose build failed: the compiler that failed (first line), then its output. A later start
with the same compiler falls back at once instead of building for a minute again."""


def _compiler() -> str:
    """The first line of the compiler's `--version`: a new compiler is worth another build."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx
    return (out.strip().splitlines() or [cxx])[0]


def _failed_before(target: Path) -> Path | None:
    """The log of an earlier failed build of `target` with this compiler, else None."""
    log = target.parent / FAILED
    try:
        return log if log.read_text(errors="replace").partition("\n")[0] == _compiler() else None
    except OSError:
        return None


_NOT_THE_SOURCES = ("Killed signal", "interrupted by user", "signal terminated", "No space left", "Cannot allocate")


def _compile_error(output: str) -> bool:
    """Whether a failed build's output shows the toolchain refusing it (`file:line: error: ...`, a linker's or the
    driver's `error:`), not the build stopped from outside (a signal, an interrupt, a full disk), which another
    start may not meet."""
    if any(text in output for text in _NOT_THE_SOURCES):
        return False
    return "error: " in output


def _first_error(exc: BaseException) -> str:
    """The line of a failed build that says why (a compiler's `error:`), else the exception's last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    error = next((line for line in lines if "error" in line.lower() and not line.startswith("Error building")), None)
    return f"{type(exc).__name__}: {error or (lines[-1] if lines else '')}"


def _build(target: Path, cap: str) -> None:
    """Compile into a fresh folder beside `target`, then move the library into place."""
    from torch.utils.cpp_extension import load as load_extension

    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process that is compiling polyvec's CPU kernels into %s", folder)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # built by the process we waited for
            torch.ops.load_library(str(target))
            return
        if (log := _failed_before(target)) is not None:  # failed for the process we waited for: not again
            raise RuntimeError(f"building them failed with this compiler: see {log}, delete it to build again")
        for stale in folder.glob("build-*"):  # left by a build that was killed; its lock died with it
            shutil.rmtree(stale, ignore_errors=True)
        logger.warning(
            "compiling polyvec's CPU kernels once for this environment (about a minute on 2 cores; cached in %s)",
            folder,
        )
        start = time.monotonic()
        scratch = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
        try:
            load_extension(
                target.stem,
                [str(p) for p in _SOURCES],
                extra_cflags=[*_CFLAGS, *_ISA_FLAGS[cap]],
                extra_ldflags=_LDFLAGS,
                build_directory=str(scratch),
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # kept, so that the next start does not spend a minute failing again
            if _compile_error(str(e)):  # not an interrupt or a compiler killed (out of memory): those build again
                (folder / FAILED).write_text(f"{_compiler()}\n{e}\n")
            raise
        finally:
            if (scratch / target.name).is_file():
                os.replace(scratch / target.name, target)
            shutil.rmtree(scratch, ignore_errors=True)
        (folder / FAILED).unlink(missing_ok=True)
        logger.warning("compiled polyvec's CPU kernels in %.0f s", time.monotonic() - start)


def load() -> bool:
    """Load the kernels (building them the first time); False, with the reason logged once, where they cannot
    be."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = False, ""
        cap = _capability()
        if cap not in _ISA_FLAGS:
            why = f"no AVX2/AVX-512 on this CPU ({cap})"
        else:
            target = library_path(cap)
            try:
                if target.is_file():
                    torch.ops.load_library(str(target))
                elif (missing := _missing_tool()) is not None:
                    why = f"no {missing} to compile them with"
                elif (log := _failed_before(target)) is not None:
                    why = f"building them failed before with this compiler: see {log}, delete it to build again"
                else:
                    _build(target, cap)
                if not why:
                    ok = all(hasattr(torch.ops.polyvec, op) for op in _OPS)
                    why = "" if ok else "the library loaded without its operators"
            except Exception as e:  # a failed build or load: SDPA still works
                why = _first_error(e)
                if (target.parent / FAILED).is_file() and FAILED not in why:
                    why += f" (the compiler's output: {target.parent / FAILED})"
        if not ok:
            logger.warning(
                "polyvec's native CPU kernels are not used (%s); attention runs on PyTorch SDPA, slower", why
            )
        _state["ok"] = ok
        return ok


def amx_linear_available() -> bool:
    """Whether bf16 projections of small batches can run on AMX tiles here (layers/linear.py)."""
    return load() and bool(torch.ops.polyvec.amx_linear_available())


def packed_attention_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether bidirectional attention can run on the packed batch with the native kernel."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    cap = _capability()
    if head_dim % VECTOR_WIDTH.get(cap, 1 << 30):
        return False
    return load()


def varlen_attention(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_heads: int,
    key_lens: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ/√d + bias) v per sequence of the packed `qkv` [T, 3·H·d] → [T, H·d]; sequence i's queries
    see its first `key_lens[i]` keys; `bias` is [heads, L, L] (or [1, heads, L, L]) by position in the
    sequence, L ≥ the longest sequence; `window`: each query sees only keys at most this many positions away."""
    head_dim = qkv.shape[1] // (3 * num_heads)
    w = -1 if window is None else window
    return torch.ops.polyvec.varlen_attention(qkv, cu_seqlens, key_lens, bias, num_heads, head_dim**-0.5, w)

"""polyvec's native CPU kernels, compiled on first use with PyTorch's C++ extension loader.

`csrc/varlen_attention.cpp` is bidirectional attention straight over the packed `qkv` projection (see its
header comment): no padded grid, no mask, each (sequence, head) on its own. `csrc/dynamic_quant.cpp` holds the
per-token quantize / dequantize passes around oneDNN's int8 matmul (`quantization="int8"`), and
`csrc/layer_norm.cpp` a one-read LayerNorm (layers/layernorm.py), `csrc/amx_linear.cpp` the bf16 projections of
small batches on AMX (layers/linear.py), with the helpers they share in `csrc/cpu_common.h`. They are built once
per machine with the compiler PyTorch's extension loader finds (g++/clang and ninja), for the vector width
PyTorch itself uses here (AVX-512 or AVX2), and cached under `TORCH_EXTENSIONS_DIR` (default
`~/.cache/torch_extensions`). Where they cannot be built (no compiler, another CPU architecture) or
`POLYVEC_DISABLE_KERNELS=1`, attention falls back to PyTorch's SDPA over a padded grid, with a warning saying
why, and `quantization="int8"` is refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("varlen_attention.cpp", "dynamic_quant.cpp", "layer_norm.cpp", "amx_linear.cpp")]
_OPS = ("varlen_attention", "quantize_rows", "layer_norm", "amx_linear")
# PyTorch's vector classes are header-only; these select the width they compile to (as ATen's own builds do).
_ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", "-mavx2", "-mfma", "-mf16c"],
}
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


def _sources_hash() -> str:
    """Of every file under csrc/, headers included: PyTorch's loader rebuilds when a listed source changes,
    not when a header they include does, so the header's contents go into the extension's name."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def load() -> bool:
    """Build (first time) and load the kernels; False, with the reason logged once, where they cannot be."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        ok, why = False, ""
        cap = _capability()
        if os.environ.get("POLYVEC_DISABLE_KERNELS", "0") == "1":
            why = "POLYVEC_DISABLE_KERNELS=1"
        elif cap not in _ISA_FLAGS:
            why = f"no AVX2/AVX-512 on this CPU ({cap})"
        else:
            try:
                from torch.utils.cpp_extension import load as load_extension

                load_extension(f"polyvec_kernels_{cap.lower()}_{_sources_hash()}", [str(p) for p in _SOURCES],
                               extra_cflags=["-O3", "-fopenmp", *_ISA_FLAGS[cap]], extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
                ok = all(hasattr(torch.ops.polyvec, op) for op in _OPS)
                why = "" if ok else "the extension loaded without its operator"
            except Exception as e:  # no compiler or ninja, a failed build: SDPA still works
                last = str(e).strip().splitlines()
                why = f"{type(e).__name__}: {last[-1] if last else ''}"
        if not ok:
            logger.warning("polyvec's native attention kernel is not used (%s); using PyTorch SDPA", why)
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


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, num_heads: int,
                     key_lens: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ/√d + bias) v per sequence of the packed `qkv` [T, 3·H·d] → [T, H·d]; sequence i's queries
    see its first `key_lens[i]` keys; `bias` is [heads, L, L] (or [1, heads, L, L]) by position in the
    sequence, L ≥ the longest sequence."""
    head_dim = qkv.shape[1] // (3 * num_heads)
    return torch.ops.polyvec.varlen_attention(qkv, cu_seqlens, key_lens, bias, num_heads, head_dim ** -0.5)

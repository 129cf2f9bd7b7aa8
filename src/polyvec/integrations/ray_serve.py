"""Replicated serving on Ray Serve: the HTTP app of `polyvec serve`, one engine per replica.

    polyvec serve MODEL --replicas 2                  # a local Ray on this machine
    polyvec serve MODEL --replicas 4 --ray auto       # the replicas spread over a running Ray cluster
    serve run polyvec.integrations.ray_serve:build model=MODEL replicas=2    # Ray's own CLI, or:

    from ray import serve
    from polyvec.integrations.ray_serve import deployment
    serve.run(deployment("MODEL", min_replicas=1, max_replicas=8), route_prefix="/")

Each replica is a Ray actor running the same FastAPI app (routes, limits, errors) over its own engine; Ray's
proxy spreads requests over the replicas, or, with `RAY_SERVE_ENABLE_HA_PROXY=1` in the Ray processes'
environment (what `polyvec serve --replicas` sets on a Ray of its own), HAProxy sends them straight to each
replica's own HTTP server. Serve restarts a replica whose process dies or whose engine thread
stops (`check_health`), and drains a replica it stops: requests in flight finish, up to
`graceful_shutdown_timeout_s`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from typing import Any

from ray import serve

from ..config import PoolerConfig
from ..engine.factory import create_engine
from ..entrypoints.server.app import ServerConfig, build_app
from . import engine_device

DEFAULT_TARGET_ONGOING_REQUESTS = 32
"""Autoscaling target: requests in progress per replica (enough to fill an engine's batches on CPU)."""


@serve.ingress()
class PolyvecReplica:
    """One engine and its HTTP app; the app's lifespan starts and stops the engine loop."""

    def __init__(self, model: str, engine_options: dict[str, Any], server_options: dict[str, Any]):
        engine = create_engine(model, **engine_options)
        self._app = build_app(engine, ServerConfig(**server_options))
        self.state = self._app.state.server

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    def check_health(self) -> None:
        """Serve calls this every few seconds; raising makes it replace the replica."""
        if not self.state.async_engine.alive:
            raise RuntimeError("the engine loop of this replica has stopped")


def deployment(
    model: str,
    *,
    replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    target_ongoing_requests: float = DEFAULT_TARGET_ONGOING_REQUESTS,
    autoscaling: dict[str, Any] | None = None,
    threads_per_replica: int | None = None,
    num_gpus: float = 0,
    graceful_shutdown_timeout_s: float = 60,
    health_check_period_s: float = 5,
    log_level: str = "INFO",
    engine_options: dict[str, Any] | None = None,
    server_options: dict[str, Any] | None = None,
) -> Any:
    """A bound Serve application: `replicas` copies (default 1), or between `min_replicas` and `max_replicas`
    scaled on requests in progress when either bound is given, starting from `replicas` (default the lower
    bound; `autoscaling`: more of Serve's autoscaling_config, e.g.
    `upscale_delay_s`). `engine_options` are `create_engine`'s keyword arguments,
    `server_options` `ServerConfig`'s. Each replica reserves `threads_per_replica` CPUs (default: all of this
    node's CPUs divided among the replicas, at least one) and uses as many threads."""
    engine_options = engine_device(dict(engine_options or {}), num_gpus)
    # Serve sends X-Request-Id with every response itself: a second one from the app would repeat it
    server_options = {**(server_options or {}), "request_id_headers": False}
    server_options.setdefault("served_model_names", [model])
    config = ServerConfig(**server_options)
    for name, value in (("replicas", replicas), ("min_replicas", min_replicas), ("max_replicas", max_replicas)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be positive, not {value}")
    if not target_ongoing_requests > 0:
        raise ValueError(f"target_ongoing_requests must be positive, not {target_ongoing_requests}")
    if threads_per_replica is not None and threads_per_replica < 1:
        raise ValueError(f"threads_per_replica must be positive, not {threads_per_replica}")
    autoscaled = min_replicas is not None or max_replicas is not None
    low = min_replicas if min_replicas is not None else 1
    high = max_replicas if max_replicas is not None else max(low, replicas or 1)
    if autoscaled and low > high:
        raise ValueError(f"min_replicas ({low}) is above max_replicas ({high})")
    if autoscaled and replicas is not None and not low <= replicas <= high:  # Serve would clamp it silently
        raise ValueError(
            f"replicas ({replicas}), the initial count, is outside min_replicas..max_replicas ({low}..{high})"
        )
    initial = replicas if replicas is not None else low
    threads = threads_per_replica if threads_per_replica is not None else engine_options.get("num_threads")
    if threads is None and not num_gpus:
        threads = default_threads(high if autoscaled else initial)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads_per_replica must be positive, not {threads}")
        engine_options["num_threads"] = threads
        check_fit(threads, initial)  # the replicas Serve starts with: it would wait for them forever
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": threads or 1, "num_gpus": num_gpus},
        # The app limits the POSTs in progress itself (429 with Retry-After beyond max_concurrent_requests), so
        # Serve may send it more; Serve's default of 5 per replica would starve the engine's batches.
        "max_ongoing_requests": 2 * config.max_concurrent_requests or 100_000,
        "max_constructor_retry_count": 3,  # a model that cannot load fails the deployment, not 20 tries later
        "logging_config": {"log_level": log_level.upper()},
        "graceful_shutdown_timeout_s": graceful_shutdown_timeout_s,
        "health_check_period_s": health_check_period_s,
    }
    if autoscaled:
        options["autoscaling_config"] = {
            "min_replicas": low,
            "initial_replicas": initial,
            "max_replicas": high,
            "target_ongoing_requests": target_ongoing_requests,
            **(autoscaling or {}),
        }
    else:
        options["num_replicas"] = initial
    replica = serve.deployment(name="polyvec", **options)(PolyvecReplica)
    return replica.bind(model, engine_options, server_options)


def node_cpus() -> list[float]:
    """CPUs of each live node of the connected Ray cluster; this machine's when Ray is not initialized."""
    import ray

    if not ray.is_initialized():
        return [float(os.cpu_count() or 1)]
    return [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")] or [0.0]


def default_threads(replicas: int) -> int:
    """Threads (and CPUs reserved) per replica: the smallest node's CPUs shared by the replicas it would hold
    if they were spread evenly over the nodes."""
    cpus = node_cpus()
    per_node = -(-replicas // len(cpus))
    return max(1, int(min(cpus)) // per_node)


def check_fit(threads: int, replicas: int) -> None:
    """ValueError if `replicas` replicas of `threads` CPUs cannot all be placed: Serve would wait for them
    forever rather than fail."""
    cpus = node_cpus()
    fits = sum(int(c // threads) for c in cpus)
    if fits < replicas:
        raise ValueError(
            f"{replicas} replica(s) of {threads} CPU(s) each do not fit on the cluster's nodes "
            f"(CPUs per node: {', '.join(f'{c:g}' for c in cpus)}); lower --threads or the replicas"
        )


_INT = ("replicas", "min_replicas", "max_replicas", "threads_per_replica")
_FLOAT = ("target_ongoing_requests", "num_gpus", "graceful_shutdown_timeout_s", "health_check_period_s")


def build(args: dict[str, str]) -> Any:
    """Ray Serve's application builder (`serve run polyvec.integrations.ray_serve:build model=M replicas=2`, or a
    Serve config file): `deployment`'s arguments as strings; any other key is an engine option
    (`dtype=float32`, `max_model_len=512`)."""
    args = dict(args)
    if "model" not in args:
        raise ValueError("give the model: serve run polyvec.integrations.ray_serve:build model=MODEL")
    model = args.pop("model")
    kwargs: dict[str, Any] = {k: int(args.pop(k)) for k in _INT if k in args}
    kwargs.update({k: float(args.pop(k)) for k in _FLOAT if k in args})
    if "log_level" in args:
        kwargs["log_level"] = args.pop("log_level")
    engine_types = {k: str(p.annotation) for k, p in inspect.signature(create_engine).parameters.items()}
    server_types = {f.name: str(f.type) for f in dataclasses.fields(ServerConfig)}
    engine: dict[str, Any] = {}
    server: dict[str, Any] = {}
    for key, value in args.items():
        if key in engine_types and key != "model":
            engine[key] = _parse(key, str(value), engine_types[key])
        elif key in server_types:
            server[key] = _parse(key, str(value), server_types[key])
        else:
            raise ValueError(f"unknown argument {key!r} (neither deployment's, create_engine's nor ServerConfig's)")
    return deployment(model, engine_options=engine, server_options=server, **kwargs)


def _parse(key: str, text: str, annotation: str) -> Any:
    """A `key=value` string as the type its annotation names (bool, int, float, a JSON list or dict, else str)."""
    try:
        if annotation.startswith("bool"):
            return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
        if annotation.startswith(("list", "dict", "tuple")):
            return json.loads(text)
        if annotation.startswith("PoolerConfig"):
            return PoolerConfig.from_dict(json.loads(text))
        if annotation.startswith("int") or annotation.startswith("float"):
            return int(text) if annotation.startswith("int") else float(text)
    except (KeyError, ValueError):
        raise ValueError(f"{key}={text!r} is not a {annotation}") from None
    return text

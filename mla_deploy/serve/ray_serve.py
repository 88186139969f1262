"""Scaling out on Ray Serve: the app of :mod:`mla_deploy.serve.app` as a Serve deployment of N replicas behind
Serve's HTTP proxy, each replica one :class:`~mla_deploy.serve.service.Service` (its own engine, cache rows and
continuous batcher). Ray routes each request to a replica (fewest requests in flight of two chosen at random),
restarts a replica whose health check fails and spreads replicas over the nodes of a cluster.

* :func:`application`: the bound Serve application (``serve.run(application(...))`` in a user's own driver).
* :func:`app_builder`: the same from ``key=value`` arguments, for Ray's own command line and config files
  (``serve run mla_deploy.serve.ray_serve:app_builder artifact=ART replicas=2``; a KubeRay ``RayService``'s
  ``serveConfigV2`` names it as its ``import_path``).
* :func:`serve_on_ray`: ``mla-deploy serve ART --replicas N [--ray-address ADDR]``: a local Ray cluster (or the one
  at ``ADDR``), the application on it, SIGTERM/SIGINT to take it down gracefully.

This module imports Ray only inside its functions: ``pip install 'mla-deploy[ray]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import InputError, MLADeployError, RuntimeMissingError
from .service import ServeOptions, Service


class Replica:
    """One Serve replica: a :class:`Service` over ``artifact`` and the FastAPI app around it (Serve runs the app's
    lifespan: the batcher starts with the replica and stops, gracefully, with it)."""

    def __init__(self, artifact: str, options: ServeOptions):
        self.service = Service(artifact, options)

    def __serve_build_asgi_app__(self):  # called by Serve after __init__, on the replica
        from .app import create_app

        return create_app(self.service)

    def check_health(self) -> None:
        """Serve's periodic health check: a replica whose engine thread has died is restarted."""
        problem = self.service.problem()
        if problem is not None:
            raise RuntimeError(problem)


def require_ray():
    """``ray.serve`` (and ``ray``). Raises: RuntimeMissingError in one line saying what to install."""
    try:
        from ray import serve
    except ImportError as exc:
        raise RuntimeMissingError(f"scaling out needs Ray Serve ({exc.name} is missing): "
                                  f"pip install 'mla-deploy[ray]'") from exc
    return serve


def application(artifact: str | Path, options: ServeOptions, replicas: int, cpus_per_replica: float | None = None):
    """The Serve application: ``replicas`` copies of :class:`Replica` over ``artifact`` (a path every node of the
    cluster can read), each reserving ``cpus_per_replica`` CPUs (default: ``options.threads``, else 1).

    Each replica takes up to ``max_batch + max_queue`` requests at once (its own rows and queue; past them it
    answers 429), and gets ``options.grace`` seconds to finish them when the application is taken down.
    Raises: InputError: ``replicas`` below 1. RuntimeMissingError: no Ray Serve.
    """
    serve = require_ray()
    if replicas < 1:
        raise InputError(f"replicas must be >= 1, got {replicas}")
    cpus = cpus_per_replica if cpus_per_replica is not None else float(options.threads or 1)
    deployment = serve.deployment(
        serve.ingress()(Replica), name="mla-deploy", num_replicas=int(replicas),
        ray_actor_options={"num_cpus": cpus}, max_ongoing_requests=options.max_batch + options.max_queue,
        graceful_shutdown_timeout_s=options.grace, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=5)
    return deployment.bind(str(Path(artifact).resolve()), options)


#: :func:`app_builder`'s arguments beside :class:`ServeOptions`' fields (host and port belong to Serve's proxy)
BUILDER_ARGS = ("artifact", "replicas", "cpus_per_replica")


def app_builder(args: Mapping[str, Any]):
    """The application from Ray's ``key=value`` arguments (all strings on the command line, typed in a YAML config):
    ``artifact`` (required), ``replicas`` (default 1), ``cpus_per_replica``, and any field of :class:`ServeOptions`
    but ``host``/``port`` (``max_batch=8``, ``max_cache_length=512``, ``threads=4``, ``api_key=...``).

    Raises: InputError: a missing artifact, an unknown argument or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(ServeOptions) if f.name not in ("host", "port")}
    unknown = sorted(set(args) - set(fields) - set(BUILDER_ARGS))
    if unknown or "artifact" not in args:
        raise InputError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(BUILDER_ARGS + tuple(fields))}"
                         if unknown else "app_builder needs artifact=PATH (an exported artifact every node can read)")
    values = {name: _typed(name, args[name], fields[name].type) for name in args if name in fields}
    if "api_key" in values:  # an empty key in a config is refused, as `--api-key ''` is, never "no key"
        from .server import check_access

        check_access("127.0.0.1", values["api_key"], None)
    cpus = args.get("cpus_per_replica")
    return application(args["artifact"], ServeOptions(**values), int(_typed("replicas", args.get("replicas", 1), "int")),
                       None if cpus is None else float(_typed("cpus_per_replica", cpus, "float")))


def _typed(name: str, value: Any, kind: str) -> Any:
    """``value`` (a string from Ray's command line, or already typed from YAML) as the field's ``kind``."""
    if value is None or not isinstance(value, str):
        return value
    base = kind.replace(" | None", "")
    try:
        if base == "bool":
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        return {"int": int, "float": float}.get(base, str)(value)
    except ValueError:
        raise InputError(f"{name}={value!r} is not {'an' if base == 'int' else 'a'} {base}") from None


def serve_on_ray(artifact: str | Path, options: ServeOptions, replicas: int, address: str | None = None,
                 announce: Callable[[str], None] = print) -> None:
    """Serve ``artifact`` with ``replicas`` replicas on Ray until SIGTERM/SIGINT, then take the application down
    (each replica gets ``options.grace`` seconds for its requests) and, when this call started it, the cluster.

    ``address``: a running cluster's (``auto``, ``ray://HOST:10001``); None starts a local one. Serve's proxy
    listens on ``options.host:options.port`` (a cluster already serving keeps the proxy options it started with).
    Raises (before anything is announced): as :func:`Service.check`; RuntimeMissingError: no Ray, or Ray cannot
    start; MLADeployError: a replica failed to start (its error, in one line). When the cluster does not answer
    within ``options.grace`` + :data:`TAKE_DOWN_MARGIN` seconds of the signal (a local cluster's processes got the
    signal too), it says so in one line and the process exits 1 at once.
    """
    serve = require_ray()
    import ray

    name = Service.check(artifact, options)
    port = options.port or _free_port(options.host)
    _check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
                 configure_logging=False)
    except Exception as exc:  # ConnectionError, RuntimeError, ValueError: Ray's words, in one line
        raise RuntimeMissingError(f"Ray could not start{' at ' + address if address else ''}: "
                                  f"{_last_line(str(exc))}") from None
    # from here on SIGTERM and SIGINT only set `stop` (ray.init put Ray's own handler in place, which aborts the
    # process with a stack dump): one arriving while Serve starts takes the application down once it is up, a
    # second one while it goes down is ignored
    with _stop_signals() as stop:
        try:
            serve.start(http_options={"host": options.host, "port": port}, logging_config={"log_level": "WARNING"})
            try:
                serve.run(application(artifact, options, replicas), name=name, route_prefix="/", blocking=False)
            except RuntimeError as exc:
                raise MLADeployError(f"a replica failed to start: {_last_line(str(exc))}") from None
        except BaseException:  # a start that failed: the cluster answers, take down what was started
            _take_down(serve, ray, None, local=address is None)
            raise
        host = f"[{options.host}]" if ":" in options.host else options.host
        announce(f"serving {name} at http://{host}:{port}/v1 ({replicas} replica{'s' * (replicas > 1)} on Ray Serve, "
                 f"each {options.max_batch} rows)")
        while not stop.wait(0.5):
            pass
        limit = options.grace + TAKE_DOWN_MARGIN
        if not _within(limit, _take_down, serve, ray, name, address is None):
            # the cluster died with us: a signal sent to the whole process group (`timeout`, `kill -- -PGID`,
            # systemd's control-group stop) reaches a local cluster's GCS and raylet too, and Ray would wait a minute
            # for them here and again at exit; nothing is left to finish, so say so and leave at once
            announce(f"error: the Ray cluster did not answer within {limit:.0f} s of the signal (it got the signal "
                     f"too: send SIGTERM or SIGINT to mla-deploy alone); `ray stop` ends what is left of a local "
                     f"cluster")
            os._exit(1)


#: seconds past ``--grace`` the application and a local cluster get to go down before the cluster counts as gone
TAKE_DOWN_MARGIN = 15.0


def _take_down(serve, ray, name: str | None, local: bool) -> None:
    """Delete application ``name`` (None: none was announced), stop Serve when the cluster is ``local`` (this call
    started it), disconnect from Ray."""
    try:
        if name is not None:
            serve.delete(name)
        if local:
            serve.shutdown()
    finally:
        ray.shutdown()


def _within(seconds: float, call: Callable, *args) -> bool:
    """Run ``call(*args)`` on a daemon thread; True when it returned (or raised) within ``seconds``."""
    thread = threading.Thread(target=call, args=args, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def _check_reachable(address: str | None) -> None:
    """A cluster's ``HOST:PORT`` answers a TCP connection within 5 s (Ray itself retries for a minute or more).
    Raises: RuntimeMissingError: nothing listens there."""
    import socket

    match = re.fullmatch(r"\[?([^\]]+?)\]?:(\d+)", address or "")
    if match is None:  # None (a new local cluster), "auto", "ray://...": Ray's own lookup and errors
        return
    try:
        socket.create_connection((match.group(1), int(match.group(2))), timeout=5).close()
    except (OSError, OverflowError) as exc:
        raise RuntimeMissingError(f"Ray could not start at {address}: no cluster answers there "
                                  f"({getattr(exc, 'strerror', None) or exc})") from None


@contextlib.contextmanager
def _stop_signals():
    """An event that SIGTERM and SIGINT set while the block runs (the handlers before it are put back after)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _free_port(host: str) -> int:
    from .server import bind

    with bind(host, 0) as sock:
        return sock.getsockname()[1]


def _last_line(text: str) -> str:
    """The line of a (remote) traceback that says what went wrong: its last ``SomeError: message`` line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
    line = (errors or lines or [text])[-1]
    return re.sub(r"^(?:[\w]+\.)+(?=\w+(Error|Exception): )", "", line)

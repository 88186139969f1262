"""``mla-deploy serve``: the app of :mod:`mla_deploy.serve.app` under uvicorn, on a socket bound before anything
is announced, shut down gracefully at SIGTERM or SIGINT (stop accepting, let in-flight requests finish for
``grace`` seconds, cancel the rest, exit 0)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

from ..errors import InputError, RuntimeMissingError
from .service import ServeOptions, Service


def require_server_packages():
    """``uvicorn`` (and FastAPI with it). Raises: RuntimeMissingError in one line saying what to install."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise RuntimeMissingError(f"serving needs {exc.name}: pip install 'mla-deploy[serve]'") from exc
    return uvicorn


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one). Raises: InputError: it cannot be bound."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        raise InputError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    sock.listen(2048)
    return sock


def serve(artifact: str | Path, options: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve ``artifact`` until SIGTERM/SIGINT. ``announce`` gets one line once requests are accepted.

    Raises (before anything listens): as :class:`~mla_deploy.serve.service.Service`; InputError: the address.
    """
    uvicorn = require_server_packages()
    from .app import create_app

    service = Service(artifact, options)
    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=max(1, int(options.grace)))

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
                announce(f"serving {service.model_name} at {url} ({options.max_batch} rows of "
                         f"{service.capacity} tokens, {service.engine.provider})")

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a handled signal is a clean exit (0), not re-raised afterwards

    _Server(config).run(sockets=[sock])

"""``mla-deploy serve``: the app of :mod:`mla_deploy.serve.app` under uvicorn, on a socket bound before anything
is announced, shut down gracefully at SIGTERM or SIGINT (stop accepting, let in-flight requests finish for
``grace`` seconds, cancel the rest, exit 0).

Connections are bounded: uvicorn's h11 protocol with ``h11_max_incomplete_event_size`` bounds the request line and
headers (uvicorn's default protocol, httptools, takes headers of any size); :func:`_protocol` adds a deadline on a
request's head, which uvicorn has none of (its keep-alive timer runs only between requests, and stops at the first
byte of the next), so a connection that never finishes its headers is closed after ``client_timeout``; the body's
deadline is the app's (:class:`~mla_deploy.serve.app._Gate`).
"""

from __future__ import annotations

import asyncio
import ipaddress
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


#: the environment variable that gives the API key (as ``--api-key`` does)
KEY_ENV = "MLA_DEPLOY_API_KEY"


def check_access(host: str, api_key: str | None, key_in_environment: str | None) -> None:
    """Refuse what would open the server by accident: an empty address (every interface), an empty key given as
    ``--api-key ''`` or as an empty ``MLA_DEPLOY_API_KEY`` (``key_in_environment``: the variable's value, None when
    unset), a key that cannot travel in an HTTP header. Raises: InputError in one line."""
    if not host.strip():
        raise InputError("--host is empty, which would listen on every interface: give an address (127.0.0.1, or "
                         "0.0.0.0 to listen on every interface on purpose)")
    if api_key is None and key_in_environment is not None:
        api_key = key_in_environment  # click passes an empty variable on as no value at all
        where = KEY_ENV
    else:
        where = "--api-key"
    if api_key is not None and not api_key.strip():
        raise InputError(f"{where} is empty, which would serve without a key: give a key, or leave {where} out "
                         f"(and unset {KEY_ENV}) to serve without one")
    if api_key is not None and not all(33 <= ord(c) < 127 for c in api_key):
        raise InputError(f"{where} must be printable ASCII without spaces (it travels in an HTTP header)")


def open_bind_warning(address: str, api_key: str | None) -> str | None:
    """The warning for a listening ``address`` that is not a loopback one when no key is set, or None."""
    try:
        loopback = ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if loopback or api_key:
        return None
    return (f"warning: listening on {address} without --api-key: anyone who can reach this port can use the model "
            f"(set --api-key or {KEY_ENV}, or bind 127.0.0.1 behind a proxy)")


def serve(artifact: str | Path, options: ServeOptions, announce: Callable[[str], None] = print) -> None:
    """Serve ``artifact`` until SIGTERM/SIGINT. ``announce`` gets one line once requests are accepted (after a
    warning line when it listens beyond loopback without a key).

    At SIGTERM/SIGINT new requests get 503, running ones may finish until :func:`cutoff` ``(grace)``; then every
    one still running ends (a stream with an error event and ``[DONE]``, a plain reply with 503), so that the
    replies are complete and the process exits within ``grace``.

    Raises (before anything listens): as :class:`~mla_deploy.serve.service.Service`; InputError: the address.
    """
    uvicorn = require_server_packages()
    from .app import create_app

    service = Service(artifact, options)
    sock = bind(options.host, options.port)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, lifespan="on",
                            http=_protocol(options), h11_max_incomplete_event_size=options.max_header_bytes,
                            timeout_keep_alive=options.client_timeout,
                            timeout_graceful_shutdown=options.grace)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                warning = open_bind_warning(host, options.api_key)
                if warning:
                    announce(warning)
                url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
                announce(f"serving {service.model_name} at {url} ({options.max_batch} rows of "
                         f"{service.capacity} tokens, {service.engine.provider})")

        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a handled signal is a clean exit (0), not re-raised afterwards

        async def shutdown(self, sockets=None):
            service.stopping = True  # new requests: 503
            end = asyncio.get_running_loop().call_later(cutoff(options.grace), service.cancel_all)
            try:
                await super().shutdown(sockets)
            finally:
                end.cancel()

    _Server(config).run(sockets=[sock])


def cutoff(grace: float) -> float:
    """Seconds after the stop signal at which the requests still running are ended: the grace less the time their
    last events take to be written (a second, a fifth of a short grace)."""
    return grace - min(1.0, grace / 5)


def _protocol(options: ServeOptions):
    """uvicorn's h11 protocol with a deadline on each request's head (the module docstring)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = options.client_timeout
    reply = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n")
    body = (b'{"error": {"message": "the request line and headers did not arrive within %g s", '
            b'"type": "timeout_error", "param": null, "code": "timeout"}}' % timeout)

    class HeadDeadline(H11Protocol):
        head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data):
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a request's head has begun and not ended
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            if self.head_timer is None and not self.transport.is_closing():
                self.head_timer = self.loop.call_later(timeout, self._expired)

        def _disarm(self):
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _expired(self):
            self.head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.write(reply % len(body) + body)
                self.transport.close()

    return HeadDeadline

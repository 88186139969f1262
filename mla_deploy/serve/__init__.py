"""Serving an artifact over HTTP with OpenAI's API (``mla-deploy serve``).

* :mod:`~mla_deploy.serve.protocol`: the request bodies and the error replies.
* :mod:`~mla_deploy.serve.service`: the engine, tokenizer and continuous batcher behind the app
  (:class:`Service`, :class:`ServeOptions`).
* :mod:`~mla_deploy.serve.app`: the FastAPI app (:func:`create_app`). :mod:`~mla_deploy.serve.metrics`: ``/metrics``.
* :mod:`~mla_deploy.serve.server`: uvicorn, the socket and the signals (:func:`serve`).

Names are imported lazily, so importing the package loads neither FastAPI nor an engine.
"""

from __future__ import annotations

from ..lazy import lazy_getattr

_LAZY = {
    "ApiError": ".protocol",
    "ServeOptions": ".service",
    "Service": ".service",
    "create_app": ".app",
    "serve": ".server",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

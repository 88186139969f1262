"""``mla-deploy serve``: an OpenAI-compatible HTTP server over an artifact, with continuous batching."""

from __future__ import annotations

import os

import click

from .groups import Runtime, RuntimeArgs
from .options import Int, IntOrAuto, Positive


@click.command()
@click.argument("artifact", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; put a proxy with TLS in front; without "
                   "--api-key a warning says so).")
@click.option("--port", default=8000, show_default=True, type=Int(minimum=0), help="TCP port (0: a free one).")
@click.option("--max-batch", default=8, show_default=True, type=Int(),
              help="Sequences decoded together: rows of the latent cache, each holding one request.")
@click.option("--max-cache-length", type=Int(),
              help="Tokens each sequence may hold, prompt plus new tokens (default: the artifact's max_cache_length). "
                   "Every decode step attends over all of them: keep it to what requests need.")
@click.option("--api-key", envvar="MLA_DEPLOY_API_KEY",
              help="Require `Authorization: Bearer KEY` on /v1/* (also from MLA_DEPLOY_API_KEY; an empty key is "
                   "refused).")
@click.option("--model-name", help="The model's id in the API (default: the artifact's name).")
@click.option("--max-queue", default=256, show_default=True, type=Int(),
              help="Requests waiting for a free row before new ones get 429 with Retry-After.")
@click.option("--request-timeout", default=600.0, show_default=True, type=Positive(),
              help="Seconds a request may run before it is ended (408).")
@click.option("--grace", default=30.0, show_default=True, type=Positive(),
              help="Seconds in-flight requests get to finish at SIGTERM/SIGINT; those still running a second "
                   "before it ends are ended (a stream with an error event and [DONE]).")
@click.option("--client-timeout", default=15.0, show_default=True, type=Positive(),
              help="Seconds a client has to send a request's headers, then its body (408 past it), and that an idle "
                   "connection is kept open.")
@click.option("--prefill-chunk", default="64", show_default=True, type=IntOrAuto(minimum=0),
              help="Prompt tokens prefilled between two decode steps of the running batch: a long prompt is prefilled "
                   "in chunks so running streams keep their pace. N: at most N tokens; 0: each prompt whole, holding "
                   "the batch; auto: each chunk sized from the measured costs to take about 0.4 of a decode step "
                   "(running streams' gaps stay near a decode step, but arriving prompts wait much longer for their "
                   "first token and a busy server's batch fills more slowly).")
@click.option("--prefix-cache-mb", default=512, show_default=True, type=Int(minimum=0),
              help="Host memory (MiB) for the prefix cache: prompts sharing a prefix with an earlier one (a system "
                   "prompt, earlier turns) reuse its latent cache rows instead of prefilling them (0: off).")
@click.option("--replicas", type=Int(),
              help="Serve N copies of the model on Ray Serve behind its HTTP proxy (a local Ray cluster, or the one "
                   "at --ray-address), each with its own engine and rows. Needs `pip install 'mla-deploy[ray]'`.")
@click.option("--ray-address", help="With --replicas: a running Ray cluster to deploy on (`auto`, or "
                                    "ray://HEAD:10001); the artifact's path must be readable on its nodes.")
@RuntimeArgs()
def serve(artifact, runtime: Runtime, replicas, ray_address, **server):
    """Serve ARTIFACT over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions (streamed or not),
    /v1/models, /health and /metrics (Prometheus). Concurrent requests share one engine by continuous batching on
    the static latent cache. Binds 127.0.0.1 unless told otherwise; SIGTERM or SIGINT stops it gracefully."""
    from ..serve.server import KEY_ENV, check_access
    from ..serve.service import ServeOptions

    check_access(server["host"], server["api_key"], os.environ.get(KEY_ENV))
    options = ServeOptions(threads=runtime.threads, provider=runtime.provider, use_engine=runtime.use_engine,
                           cuda=runtime.cuda, **server)
    announce = lambda line: click.echo(f"mla-deploy: {line}", err=True)  # noqa: E731
    if replicas is None and ray_address is None:
        from ..serve.server import serve as run_server

        return run_server(artifact, options, announce=announce)
    from ..serve.ray_serve import serve_on_ray

    serve_on_ray(artifact, options, replicas or 1, ray_address, announce=announce)

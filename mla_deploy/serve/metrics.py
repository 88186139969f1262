"""``/metrics`` in Prometheus' text format (``prometheus_client``, one registry per server, nothing global).

Requests by endpoint and status; time to first token and inter-token latency histograms (observed by each
request as its tokens reach the server); and, read from the batcher's :class:`~mla_deploy.generate.batching.BatchStats`
when scraped: the queue depth, rows in use, latent cache rows held, prompt and generated tokens, decode steps and
the rows they carried (their ratio: mean batch occupancy), the seconds spent in engine steps and the engine's
generated tokens per second of that time.
"""

from __future__ import annotations

from ..generate.batching import ContinuousBatcher

#: latency buckets (seconds): milliseconds for an inter-token step up to minutes for a first token behind a queue
BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)


class Metrics:
    """The server's metrics over ``batcher`` (see the module docstring)."""

    def __init__(self, batcher: ContinuousBatcher, model: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("mla_deploy_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("mla_deploy_time_to_first_token_seconds", "from submission to the first token",
                              buckets=BUCKETS, registry=self.registry)
        self.itl = Histogram("mla_deploy_inter_token_latency_seconds", "between two tokens of one request",
                             buckets=BUCKETS, registry=self.registry)
        self.registry.register(_BatcherCollector(batcher, model))

    def token(self, seconds: float, first: bool) -> None:
        """A request's token reached the server ``seconds`` after its previous one (after its submission: ``first``)."""
        (self.ttft if first else self.itl).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _BatcherCollector:
    """The batcher's gauges and counters, read when scraped."""

    def __init__(self, batcher: ContinuousBatcher, model: str):
        self.batcher, self.model = batcher, model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        batcher, stats = self.batcher, self.batcher.stats
        held = sum(int(batcher.state.lengths[r]) for r, t in enumerate(batcher.slots) if t is not None)
        gauges = {
            "queue_depth": ("requests waiting for a row", stats.waiting),
            "batch_rows": ("rows of the running batch (--max-batch)", stats.rows),
            "batch_rows_in_use": ("rows holding a running sequence", stats.active),
            "cache_rows_in_use": ("latent cache rows held by running sequences", held),
            "cache_rows": ("latent cache rows in all (rows of the batch x tokens per row)", stats.rows * batcher.capacity),
            "engine_tokens_per_second": ("generated tokens per second of engine step time",
                                         stats.generated_tokens / stats.step_seconds if stats.step_seconds else 0.0),
        }
        counters = {
            "prompt_tokens": ("prompt tokens prefilled", stats.prompt_tokens),
            "generated_tokens": ("tokens generated", stats.generated_tokens),
            "decode_steps": ("decode steps run", stats.decode_steps),
            "decode_rows": ("running sequences summed over decode steps", stats.decode_rows),
            "engine_seconds": ("seconds in engine steps (prefill and decode)", stats.step_seconds),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"mla_deploy_{name}", doc, value=value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"mla_deploy_{name}", doc, value=value)
        info = GaugeMetricFamily("mla_deploy_model_info", "the model served", labels=["model"])
        info.add_metric([self.model], 1)
        yield info

"""``/metrics`` in Prometheus' text format (``prometheus_client``, one registry per server, nothing global).

Requests by endpoint and status; time to first token and inter-token latency histograms (observed by each
request as its tokens reach the server); and, read from the batcher's :class:`~mla_deploy.generate.batching.BatchStats`
when scraped: the queue depth, rows in use, latent cache rows held, prompt and generated tokens, decode steps and
the rows they carried (their ratio: mean batch occupancy), the seconds spent in engine steps and the engine's
generated tokens per second of that time; the prefill's calls and the prompt tokens it ran, and the prefix cache's
counters under vLLM's names where they mean the same (``prefix_cache_queries``/``prefix_cache_hits``: prompt tokens
looked up / found) and SGLang's hit rate (``cache_hit_rate``).
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
            "prefill_chunk_tokens": ("the most prompt tokens the last prefilling step could run", stats.chunk_tokens),
            "engine_tokens_per_second": ("generated tokens per second of engine step time",
                                         stats.generated_tokens / stats.step_seconds if stats.step_seconds else 0.0),
        }
        counters = {
            "prompt_tokens": ("prompt tokens of the requests admitted (once per request)", stats.prompt_tokens),
            "generated_tokens": ("tokens generated", stats.generated_tokens),
            "decode_steps": ("decode steps run", stats.decode_steps),
            "decode_rows": ("running sequences summed over decode steps", stats.decode_rows),
            "engine_seconds": ("seconds in engine steps (prefill and decode)", stats.step_seconds),
        }
        counters["prefill_tokens"] = ("prompt tokens run through prefill (the rest came from the prefix cache)",
                                      stats.prefill_tokens)
        counters["prefill_calls"] = ("prefill runs (a prompt in chunks is several: --prefill-chunk)",
                                     stats.prefill_calls)
        prefix = batcher.prefix.stats if batcher.prefix is not None else None
        if prefix is not None:
            counters.update({
                "prefix_cache_queries": ("prompt tokens looked up in the prefix cache", prefix.queries),
                "prefix_cache_hits": ("prompt tokens found in the prefix cache: cache rows reused, not prefilled",
                                      prefix.hits),
                "prefix_cache_hit_requests": ("requests that reused a stored prefix", prefix.hit_requests),
                "prefix_cache_evicted_blocks": ("prefix cache blocks evicted (least recently used first)",
                                                prefix.evicted),
            })
            gauges.update({
                "prefix_cache_bytes": ("bytes of latent cache rows the prefix cache holds", prefix.bytes),
                "prefix_cache_budget_bytes": ("the prefix cache's byte budget (--prefix-cache-mb)", prefix.budget),
                "prefix_cache_blocks": ("blocks the prefix cache holds", prefix.blocks),
                "cache_hit_rate": ("prompt tokens found in the prefix cache per token looked up",
                                   prefix.hits / prefix.queries if prefix.queries else 0.0),
            })
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"mla_deploy_{name}", doc, value=value)
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"mla_deploy_{name}", doc, value=value)
        info = GaugeMetricFamily("mla_deploy_model_info", "the model served", labels=["model"])
        info.add_metric([self.model], 1)
        yield info

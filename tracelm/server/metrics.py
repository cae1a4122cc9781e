"""GET /metrics: the server in Prometheus' text format (prometheus_client), on a registry of the server's own.

Each Server has its own CollectorRegistry (never prometheus_client's global one), so several apps in one process
(tests, an embedding host) keep their numbers apart. What it exports:

- `tracelm_http_requests_total{route, status}`: requests answered, by route (the route's path pattern, or
  "other" for a path no route serves: the label set stays bounded) and HTTP status;
- `tracelm_http_request_duration_seconds{route}`: a histogram of the time from a request's arrival to the end of
  its answer (a streamed answer's last byte);
- `tracelm_time_to_first_token_seconds`: a histogram of the time from a generation request's admission to the
  engine to its first sampled token (queue wait, prefill and the first draw);
- read from the engine when scraped: `tracelm_prompt_tokens_total`, `tracelm_prompt_cached_tokens_total`,
  `tracelm_generated_tokens_total`, `tracelm_engine_requests_total{outcome}` (served, cancelled, timed_out,
  cpu_limited, rejected, failed), `tracelm_requests_running`, `tracelm_queue_depth`, `tracelm_kv_cache_bytes{kind}`
  (the bytes every runner's Cache holds -- keys and values, RoPE tables, masks, pass buffers -- for the kept
  sessions and for the scratch runners of requests without one), `tracelm_model_bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OUTCOMES = ("served", "cancelled", "timed_out", "cpu_limited", "rejected", "failed")


class EngineCollector:
    """The engine's counters and state, read when /metrics is scraped (nothing is counted twice)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e, c = self.engine, self.engine.counters
        yield CounterMetricFamily("tracelm_prompt_tokens", "Prompt tokens of the requests served (cached ones "
                                  "included)", value=c.prompt_tokens)
        yield CounterMetricFamily("tracelm_prompt_cached_tokens", "Prompt tokens whose keys and values were "
                                  "reused from a Cache", value=c.reused_tokens)
        yield CounterMetricFamily("tracelm_generated_tokens", "Tokens generated", value=c.generated_tokens)
        outcomes = CounterMetricFamily("tracelm_engine_requests", "Generation requests the engine ended, by outcome",
                                       labels=["outcome"])
        for name in OUTCOMES:
            outcomes.add_metric([name], getattr(c, name))
        yield outcomes
        yield GaugeMetricFamily("tracelm_requests_running", "Sequences decoding now (in the batch)", value=e.running)
        yield GaugeMetricFamily("tracelm_queue_depth", "Requests admitted and waiting for the engine", value=e.queued)
        memory = e.memory()
        kv = GaugeMetricFamily("tracelm_kv_cache_bytes", "Bytes the runners' Caches hold (keys, values, RoPE "
                               "tables, masks, pass buffers)", labels=["kind"])
        kv.add_metric(["sessions"], memory["sessions_bytes"])
        kv.add_metric(["scratch"], memory["scratch_bytes"])
        yield kv
        yield GaugeMetricFamily("tracelm_model_bytes", "Bytes of the model's weights in memory",
                                value=memory["model_bytes"])


class Metrics:
    """A server's registry and the instruments the HTTP side and the engine observe into."""

    def __init__(self, engine: Any):
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tracelm_http_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=registry)
        self.latency = Histogram("tracelm_http_request_duration_seconds", "Time from a request's arrival to the end "
                                 "of its answer", ["route"], buckets=LATENCY_BUCKETS, registry=registry)
        self.first_token = Histogram("tracelm_time_to_first_token_seconds", "Time from a generation request's "
                                     "admission to its first sampled token", buckets=LATENCY_BUCKETS,
                                     registry=registry)
        registry.register(EngineCollector(engine))
        engine.on_first_token = self.first_token.observe  # called on the engine's worker thread (thread-safe)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def route_label(routes: Sequence[BaseRoute], scope: dict[str, Any]) -> str:
    """The path pattern of the route that serves `scope` (also when the method is wrong), else "other"."""
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            return getattr(route, "path", "other")
    return "other"


class MetricsMiddleware:
    """ASGI middleware: counts every HTTP request by route and status and times it to its answer's last byte (an
    exception no handler answered counts as 500)."""

    def __init__(self, app: Any, metrics: Metrics, routes: Sequence[BaseRoute]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route, t0, status = route_label(self.routes, scope), time.perf_counter(), 500

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - t0)


def metrics_routes(server: Any) -> list[Route]:
    """GET /metrics (behind the API key when one is set)."""

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return [Route("/metrics", metrics, methods=["GET"])]

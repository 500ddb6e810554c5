"""GET /metrics: the service in Prometheus' text format (prometheus-client).

Two sources:
- this API process's own HTTP traffic, recorded by a middleware: requests and their latency by
  route template (never the raw path: ids would make unbounded label values), method and status;
- the shared store, read at scrape time by a collector: requests by kind and state, the latency of
  finished requests by kind (queue wait, created -> claimed, and total, created -> finished) as
  histograms, live and busy workers, jobs by state, and each tenant's usage. Every API instance
  thus reports the same service-wide numbers, and the worker processes hand nothing over.

The page names tenants and their usage, so it is the operator's: it answers only a bearer token
equal to LOCKSTEP_OPERATOR_TOKEN, and is off (404) when none is set.
"""

from __future__ import annotations

import hmac
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from sqlalchemy import case, func, select

from lockstep.service.db import Job, Tenant, Usage
from lockstep.service.db import Request as RequestRow
from lockstep.service.service_metrics import busy_workers, live_workers
from lockstep.service.types import RequestState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class HttpMetrics:
    """ASGI middleware: every HTTP request's count and latency, by route template."""

    def __init__(self, app, metrics: "Metrics"):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [500]

        async def recorded(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recorded)
        finally:
            route = self.metrics.route_label(scope.get("route"))
            self.metrics.http_requests.labels(route, scope["method"], str(status[0])).inc()
            self.metrics.http_latency.labels(route, scope["method"]).observe(time.perf_counter() - started)


def _seconds(dialect: str, start, end):
    """end - start in seconds, as SQL (the store is SQLite or PostgreSQL)."""
    if dialect == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86400.0
    return func.extract("epoch", end - start)


class StoreCollector:
    """Service-wide numbers from the store, computed at each scrape."""

    def __init__(self, sessions):
        self.sessions = sessions

    def collect(self):
        with self.sessions() as s:
            dialect = s.get_bind().dialect.name
            yield from self._requests(s)
            for name, column, what in (("lockstep_request_queue_wait_seconds", RequestRow.claimed_at,
                                        "Time from a request's arrival to a worker claiming it"),
                                       ("lockstep_request_duration_seconds", RequestRow.finished_at,
                                        "Time from a request's arrival to its result")):
                yield self._latency(s, dialect, name, column, what)
            yield from self._workers(s)
            jobs = GaugeMetricFamily("lockstep_jobs", "Jobs by state", labels=("state",))
            for state, n in s.execute(select(Job.state, func.count()).group_by(Job.state)):
                jobs.add_metric((state,), n)
            yield jobs
            usage = CounterMetricFamily("lockstep_tenant_usage", "Metered usage by tenant and kind (tokens, seconds)",
                                        labels=("tenant", "kind"))
            for tenant, kind, amount in s.execute(select(Tenant.name, Usage.kind, func.sum(Usage.amount))
                                                  .join(Tenant, Tenant.id == Usage.tenant_id)
                                                  .group_by(Tenant.name, Usage.kind)):
                usage.add_metric((tenant, kind), float(amount or 0.0))
            yield usage

    def _requests(self, s):
        live = GaugeMetricFamily("lockstep_requests_in_flight", "Requests queued or running, by kind",
                                 labels=("kind", "state"))
        ended = CounterMetricFamily("lockstep_requests_completed", "Requests finished, by kind and outcome",
                                    labels=("kind", "state"))
        for kind, state, n in s.execute(select(RequestRow.kind, RequestRow.state, func.count())
                                        .group_by(RequestRow.kind, RequestRow.state)):
            (live if state in (RequestState.QUEUED.value, RequestState.RUNNING.value) else ended).add_metric((kind, state), n)
        yield live
        yield ended

    @staticmethod
    def _latency(s, dialect: str, name: str, end, what: str) -> HistogramMetricFamily:
        seconds = _seconds(dialect, RequestRow.created_at, end)
        columns = [func.sum(case((seconds <= b, 1), else_=0)) for b in LATENCY_BUCKETS]
        query = (select(RequestRow.kind, func.count(), func.sum(seconds), *columns)
                 .where(end.is_not(None), RequestRow.state.in_((RequestState.DONE.value, RequestState.FAILED.value)))
                 .group_by(RequestRow.kind))
        family = HistogramMetricFamily(name, what, labels=("kind",))
        for kind, count, total, *below in s.execute(query):
            buckets = [(str(b), int(n or 0)) for b, n in zip(LATENCY_BUCKETS, below)] + [("+Inf", int(count))]
            family.add_metric((kind,), buckets, float(total or 0.0))
        return family

    @staticmethod
    def _workers(s):
        yield GaugeMetricFamily("lockstep_workers", "Workers with a current lease", value=live_workers(s))
        yield GaugeMetricFamily("lockstep_workers_busy", "Workers running a request now", value=busy_workers(s))


class Metrics:
    """The API's registry: its HTTP middleware's series and the store's."""

    def __init__(self, sessions, operator_token: str | None):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(sessions))
        self.operator_token = operator_token
        self._route_names: dict[int, str] = {}
        self.http_requests = Counter("lockstep_http_requests", "HTTP requests answered by this API process",
                                     ("route", "method", "status"), registry=self.registry)
        self.http_latency = Histogram("lockstep_http_request_duration_seconds", "Time to answer an HTTP request",
                                      ("route", "method"), buckets=LATENCY_BUCKETS, registry=self.registry)

    def name_routes(self, router, prefix: str) -> None:
        """Label `router`'s routes with their full path templates: FastAPI runs an included
        router's own route objects, whose paths lack the prefix it was included under."""
        for route in router.routes:
            if getattr(route, "path", None) is not None:  # (an included router is named by its own call)
                self._route_names[id(route)] = prefix + route.path

    def route_label(self, route) -> str:
        if route is None:
            return "unmatched"
        return self._route_names.get(id(route)) or getattr(route, "path", None) or "unmatched"

    def allowed(self, authorization: str | None) -> bool:
        if not self.operator_token:
            return False
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), self.operator_token.encode())

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

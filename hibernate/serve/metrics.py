"""``/metrics``: what the proxy and its backends did, in Prometheus format (prometheus-client).

Each proxy has its own registry (not the library's global one), so two proxies
in one process (tests) do not share counters. The names are documented in the
README ("Serving models"); a test checks they are all exposed.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)

from hibernate.version import __version__

# No `*_created` series: a timestamp per label set that doubles the exposition and that nothing here
# needs (the library's setting is process-wide; this process is the proxy).
disable_created_metrics()

PREFIX = "hibernate_serve_"
# Wakes and sleeps take from a fraction of a second (a small model from page cache) to minutes.
TRANSITION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
OPERATIONS = ("sleep", "wake", "start")
# How a forwarded request ended: its answer sent whole; its client left before the end (a stream
# cancelled); the backend failed mid-answer, or before it (502); refused by the proxy (4xx, 503).
# probe_answered: a probe of the backend the proxy answered itself (not awake, or its action "answer").
OUTCOMES = ("completed", "client_cancelled", "backend_failed", "refused", "probe_answered")


class Recorder:
    """Every metric of one proxy, with one method per thing that happens."""

    def __init__(self, states: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry()
        self._states = states
        r = self.registry
        self.backend_state = Gauge(
            PREFIX + "backend_state",
            "1 for the state the backend is in, 0 for the others",
            ["backend", "state"],
            registry=r,
        )
        self.model_state = Gauge(
            PREFIX + "model_state",
            "1 for the state the model's backend is in, 0 for the others, by the model name clients send",
            ["model", "backend", "state"],
            registry=r,
        )
        self._models: dict[str, tuple[str, ...]] = {}  # backend -> the model names routed to it
        self.transitions = Counter(
            PREFIX + "transitions", "Completed sleeps and wakes", ["backend", "operation"], registry=r
        )
        self.failures = Counter(
            PREFIX + "transition_failures",
            "Sleeps and wakes that failed",
            ["backend", "operation"],
            registry=r,
        )
        self.durations = Histogram(
            PREFIX + "transition_seconds",
            "Duration of completed sleeps and wakes",
            ["backend", "operation"],
            buckets=TRANSITION_BUCKETS,
            registry=r,
        )
        self.spilled = Counter(PREFIX + "spilled_bytes", "Bytes written by sleeps", ["backend"], registry=r)
        self.reused = Counter(
            PREFIX + "reused_bytes",
            "Bytes of sleeps reused from the previous snapshot (unchanged: linked, not written again)",
            ["backend"],
            registry=r,
        )
        self.restored = Counter(
            PREFIX + "restored_bytes", "Bytes read back by wakes", ["backend"], registry=r
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Requests answered, by backend ('' when none) and status code",
            ["backend", "code"],
            registry=r,
        )
        self.in_flight_gauge = Gauge(
            PREFIX + "requests_in_flight",
            "Requests being forwarded (streams until their end)",
            ["backend"],
            registry=r,
        )
        self.waiting_gauge = Gauge(
            PREFIX + "requests_waiting", "Requests held while their backend wakes", ["backend"], registry=r
        )
        self.wait_seconds = Histogram(
            PREFIX + "wait_seconds",
            "How long requests were held for a wake",
            ["backend"],
            buckets=TRANSITION_BUCKETS,
            registry=r,
        )
        self.outcomes = Counter(
            PREFIX + "request_outcomes",
            "Requests by how they ended: " + ", ".join(OUTCOMES),
            ["backend", "outcome"],
            registry=r,
        )
        self.tracked_bytes = Gauge(
            PREFIX + "tracked_bytes",
            "The memory the backend's agents track (on the GPU awake, in the snapshot asleep)",
            ["backend"],
            registry=r,
        )
        self.build = Info(PREFIX + "build", "The hibernate version serving", registry=r)
        self.build.info({"version": __version__})
        self.added_latency = Histogram(
            PREFIX + "added_latency_seconds",
            "Time to first byte through the proxy minus the backend's own, wake waits excluded",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def register(self, backend: str, state: str, models: tuple[str, ...] = ()) -> None:
        """Every series of ``backend`` (and of the ``models`` routed to it) at zero from the start (in
        ``state`` until adopted), so a rate() or an alert on a counter works before its first event."""
        self._models[backend] = models
        self.state(backend, state)
        for operation in OPERATIONS:
            self.transitions.labels(backend, operation)
            self.failures.labels(backend, operation)
            self.durations.labels(backend, operation)
        for counter in (self.spilled, self.reused, self.restored):
            counter.labels(backend)
        for outcome in OUTCOMES:
            self.outcomes.labels(backend, outcome)
        self.in_flight_gauge.labels(backend).set(0)
        self.waiting_gauge.labels(backend).set(0)
        self.tracked_bytes.labels(backend).set(0)
        self.wait_seconds.labels(backend)
        self.added_latency.labels(backend)

    def state(self, backend: str, state: str) -> None:
        for name in self._states:
            self.backend_state.labels(backend, name).set(1 if name == state else 0)
            for model in self._models.get(backend, ()):
                self.model_state.labels(model, backend, name).set(1 if name == state else 0)

    def transition(
        self,
        backend: str,
        operation: str,
        seconds: float,
        written: int = 0,
        reused: int = 0,
        restored: int = 0,
    ) -> None:
        self.transitions.labels(backend, operation).inc()
        self.durations.labels(backend, operation).observe(seconds)
        self.spilled.labels(backend).inc(written)
        self.reused.labels(backend).inc(reused)
        self.restored.labels(backend).inc(restored)

    def failed(self, backend: str, operation: str) -> None:
        self.failures.labels(backend, operation).inc()

    def request(self, backend: str, code: int, outcome: str | None = None) -> None:
        """A request answered with ``code``; its outcome (by default: completed below 400, refused from
        400, backend_failed for 502) counted too when it reached a backend."""
        self.requests.labels(backend, str(code)).inc()
        if backend:
            if outcome is None:
                outcome = "completed" if code < 400 else "backend_failed" if code in (502, 504) else "refused"
            self.outcomes.labels(backend, outcome).inc()

    def tracked(self, backend: str, nbytes: int) -> None:
        self.tracked_bytes.labels(backend).set(nbytes)

    def in_flight(self, backend: str, count: int) -> None:
        self.in_flight_gauge.labels(backend).set(count)

    def waiting(self, backend: str, count: int) -> None:
        self.waiting_gauge.labels(backend).set(count)

    def waited(self, backend: str, seconds: float) -> None:
        self.wait_seconds.labels(backend).observe(seconds)

    def latency(self, backend: str, seconds: float) -> None:
        self.added_latency.labels(backend).observe(max(seconds, 0.0))

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

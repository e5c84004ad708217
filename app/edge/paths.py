"""The paths the edge treats apart: the kubelet's probes and the metrics scrape."""

from __future__ import annotations

PROBE_PATHS = frozenset({"/health", "/ready"})  # no credentials, never capped, logged at debug level
METRICS_PATH = "/metrics"

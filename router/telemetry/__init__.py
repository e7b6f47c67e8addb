"""Telemetry: the router's Prometheus metrics and the lock-free counters the event loop keeps;
a leaf every other router package may import."""

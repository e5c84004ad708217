"""Probes, the model list and the metrics scrape."""

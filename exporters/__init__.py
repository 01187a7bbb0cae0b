"""Exporters: translate the latest snapshot to Prometheus, OpenTelemetry, Perfetto."""

"""Detectors: pure judgements over history (leak, health, thermal, launch)."""

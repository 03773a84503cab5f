"""Measurements of this machine that feed the analytic model (above the trainer)."""

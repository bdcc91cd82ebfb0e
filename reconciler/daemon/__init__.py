"""The `run` loop: watch, per-volume chains, status, sd_notify, metrics."""

"""plan(desired, observed) -> steps: pure, deterministic, with refusals;
the snapshot and clone rules."""

"""Exploration on top of the simulator: the demo, benchmarks (later: sweeps, plans, reports)."""

"""Reading compiled programs: memory, collectives, the analytic model, per-leaf placement."""

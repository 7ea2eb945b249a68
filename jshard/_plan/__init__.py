"""Planning: compile a user's step on a simulated mesh, search configurations, estimate step time."""

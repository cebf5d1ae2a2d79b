"""Many agents: plan a request, run it, hold its tasks, record it."""

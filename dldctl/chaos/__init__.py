"""Chaos engineering for a live run: faults (inject.py), plans and schedules (plan.py, pure),
experiment verdicts (verdict.py, pure) and the foreground loops that drive them (runner.py)."""

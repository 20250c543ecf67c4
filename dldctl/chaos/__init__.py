"""Chaos experiments against a live run: injecting one fault (inject.py), plans and schedules
(plan.py, pure), experiment verdicts (verdict.py, pure) and the foreground loops that drive them
(runner.py). How a fault is done and undone is dldctl/faults/."""

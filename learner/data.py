"""The old import path of the built-in data helpers (`from learner import data`), kept for model
factories written against it; they live in `workload.data` now."""

from workload.data import *  # noqa: F403 (the old import path, kept for factories written against it)

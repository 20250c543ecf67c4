"""The learner: a training worker that streams compressed fragments of its progress to the syncer."""

import time

STARTED = time.monotonic()  # this process's start (a warm spare: its assignment), for the time to the first step

"""The learner: a training worker that streams compressed fragments of its progress to the syncer."""

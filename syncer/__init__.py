"""The syncer: merges learners' outer gradients per fragment and publishes the global model."""

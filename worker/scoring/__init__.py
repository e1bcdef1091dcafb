"""Chat messages to verdicts: the batch scoring engine, the probe watcher, the review
routing policy (``review``) and the scorer role."""

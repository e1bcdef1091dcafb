"""Chat messages to verdicts: the batch scoring engine, the probe watcher and the scorer role."""

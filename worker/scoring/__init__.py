"""Chat messages to verdicts: the batch scoring engine, the probe watcher, the review
routing policy (``review_routing``: which verdicts go to people; the queue they join is
:mod:`worker.review`) and the scorer role."""

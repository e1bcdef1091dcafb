"""Chat messages to verdicts: the batch scoring engine (``batch``; one probe's pass over the
states ``probe_run``, what each probe name serves ``served``), the probe watcher, the review
routing policy (``review_routing``: which verdicts go to people; the queue they join is
:mod:`worker.review`) and the scorer role."""

"""Chat messages to verdicts: the scoring engine (``engine``; what it writes to Redis
``ledger``), the batch scoring it runs (``batch``; one probe's pass over the states
``probe_run``, what each probe name serves ``served``), the probe watcher, the review
routing policy (``review_routing``: which verdicts go to people; the queue they join is
:mod:`worker.review`), the scorer role (``scorer``) and the front door that ``serve`` and
the inline guard share (``front``)."""

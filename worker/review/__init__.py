"""The review queue: ``moderation.review`` in, human answers out as ``HumanLabel``.

``queue`` (the items a console offers, consumed as the console's group on the shared batch
loop, answers produced after an undo window, offsets committed up to the oldest unanswered
item; its docstring states when an item leaves the queue; the flusher that sends the answers
is ``sender``), ``desk`` (the reviewers' side of it: the items in memory, claimed, answered,
skipped, undone) and ``claims`` (one reviewer per item at a time, with a timeout, in Redis).
A domain beside ``scoring`` and ``learning``: it imports the adapters (``kafka``, ``store``)
and never the web console, which imports it.
"""

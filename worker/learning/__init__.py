"""Human labels to probe versions.

The replay buffer and prequential window (``replay``), the online learner
(``online_learner``: row preparation, learning, versions to publish) and the updater role
(``updater``: labels in, checkpoints out).
"""

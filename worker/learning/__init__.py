"""Human labels to probe versions.

The replay buffer and prequential window (``replay``), the online learner, which
turns extracted hidden states into Lion steps (``online_learner``), and the updater
role, its Kafka and Redis shell (``updater``).
"""

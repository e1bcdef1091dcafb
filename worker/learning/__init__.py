"""Human labels to probe versions.

The replay buffer and prequential window (``replay``), the online learner and the
updater role (``updater``).
"""

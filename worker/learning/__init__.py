"""Human labels to probe versions.

The replay buffer and prequential window (``replay``), the online learner
(``online_learner``: row preparation, learning, versions to publish; its settings
``config``, its publish-time calibration ``recalibrate``) and the updater role (``updater``:
labels in, checkpoints out; which labels it takes ``intake``, what a publish writes
``publishing``).
"""

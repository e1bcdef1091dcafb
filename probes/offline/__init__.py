"""Offline work on cached hidden states: datasets, the cache format, ``fit``, model
selection (cross-validation), per-layer curves and control tasks.

The services never load this family: ``probes`` and ``probes.kinds`` must not import it
(``tests/unit/project/test_layers.py``). ``worker/offline`` is its file and CLI glue.
"""

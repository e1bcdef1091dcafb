"""The frozen LLM: everything that imports transformers.

Loading and fingerprints (``load``), hidden-state extraction (``extract``) and the
logit lens (``lens``).
"""

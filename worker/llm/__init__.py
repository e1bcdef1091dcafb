"""The frozen LLM: everything that imports transformers.

Loading, GGUF dequantizing and autocast (``load``), the LLM's fingerprint hashes
(``fingerprint``), hidden-state extraction (``extract``) and the logit lens (``lens``).
"""

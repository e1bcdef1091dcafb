"""The frozen LLM: everything that imports transformers.

Finding the weights (``source``), loading, GGUF dequantizing and autocast (``load``), the
LLM's fingerprint hashes (``fingerprint``), hidden-state extraction (``extract``; a text's
cleaning and tokens are ``text``, the cut into passes ``plan``, the forward pass and its
early exit ``forward``), the logit lens (``lens``), and a tiny random LLM built in-process
for the tests and the benches (``tiny``).
"""

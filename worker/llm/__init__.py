"""The frozen LLM: everything that imports transformers.

Finding the weights (``source``), loading and GGUF dequantizing (``load``), the loaded
model and its layer stack (``model``), device, dtype and autocast (``precision``), the
LLM's fingerprint hashes (``fingerprint``), the canonical text and the chat form
(``canonical``, ``chat_form``), hidden-state extraction (``extract``; a text's
cleaning and tokens are ``text``, the cut into passes ``plan``, the forward pass and its
early exit ``forward``; the hooks that take a layer's states from a pass, the extractor's
and the inline guard's, ``hooks``), the logit lens (``lens``), and a tiny random LLM built
in-process for the tests and the benches (``tiny``).
"""

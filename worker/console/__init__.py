"""The web console (``probeguard console``): review queue, probes, explanations.

``app`` (the FastAPI application and its pages; the review queue it serves is
:mod:`worker.review`), ``auth`` and ``web`` (users, sessions, CSRF, security headers),
``server`` (uvicorn on a thread). Layering: may import anything in ``worker`` below it;
only ``worker.commands`` and ``worker.demo`` import it.
"""

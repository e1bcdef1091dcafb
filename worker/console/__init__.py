"""The web console (``probeguard console``): review queue, probes, explanations.

``app`` (the FastAPI application and its pages), ``queue`` (the review queue over Kafka
with claims in Redis), ``auth`` and ``web`` (users, sessions, CSRF, security headers),
``server`` (uvicorn on a thread). Layering: may import anything in ``worker`` below it;
only ``worker.commands`` and ``worker.demo`` import it.
"""

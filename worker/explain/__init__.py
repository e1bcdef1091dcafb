"""How a verdict forms: the per-layer breakdown (breakdown.py), the probe it explains
(source.py: a checkpoint or a registry version, verified) and its terminal/HTML rendering
(render.py)."""

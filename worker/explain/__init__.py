"""How a verdict forms: the per-layer breakdown (breakdown.py) and its terminal/HTML
rendering (render.py)."""

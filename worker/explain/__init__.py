"""How a verdict forms: the per-layer report and its terminal/HTML rendering."""

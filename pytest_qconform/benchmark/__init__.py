"""The benchmark harness (``pytest --qconform --benchmark-only``) and its plot."""

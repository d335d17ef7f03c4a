"""The conformance suites: one module per property family, collected by ``pytest --qconform``."""

"""pytest-qconform: the conformance test suite for 4-bit quantization backends.

Public API (stable): ``pytest_qconform.reference`` (the float64 reference),
``pytest_qconform.backends.base`` (the adapter contract), ``pytest_qconform.probe``
(``Probe``, ``probe_hardware``), ``pytest_qconform.report`` (``read_report``).
Modules whose names start with an underscore, and ``plugin``, ``fixtures``, ``recorder``,
``session_setup``, ``state`` and ``outcomes``, are internal.
"""
__version__ = "0.1.0"

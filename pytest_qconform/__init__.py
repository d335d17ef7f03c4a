"""pytest-qconform: the conformance test suite for 4-bit quantization backends.

Public API (stable; ``docs/downstream.md`` documents it):

- ``pytest_qconform.backends.base``: ``Backend``, ``Availability``, ``QuantSpec``,
  ``Capabilities``, ``Quantized`` (the adapter contract a backend implements).
- ``pytest_qconform.backends.registry``: ``ENTRY_POINT_GROUP`` (``"pytest_qconform.backends"``,
  where installed packages register backends), ``discover``, ``create``, ``UnknownBackendError``.
- The hook ``pytest_qconform_backends(config)`` (``hookspecs``), for conftest.py backends.
- ``pytest_qconform.session.outcomes``: the skip-reason prefixes ``NOT_CLAIMED_PREFIX``,
  ``UNAVAILABLE_PREFIX``, ``OOM_PREFIX`` (what a skip means in the matrix).
- ``pytest_qconform.reference``: the float64 reference, with ``reference.packed``
  (``PackedBnb4``, ``PackedHqq4``: the records ``Backend.export_packed`` returns).
- ``pytest_qconform.hardware.probe``: ``Probe``, ``probe_hardware``.
- ``pytest_qconform.report.run_report``: ``read_report``, ``RunReport``, ``Cell`` (schema: docs/report-schema.md).
- The ``--qconform*`` options and ini settings, the markers, ``python -m pytest_qconform.matrix.cli``,
  ``python -m pytest_qconform doctor`` and ``python -m pytest_qconform check`` (``gate``).

Modules whose names start with an underscore, and ``plugin``, ``fixtures``, ``recorder``,
``session_setup``, ``state``, ``targets``, ``known_failures``, ``strategies``, ``kernels``
and the rest of ``outcomes``, are internal.
"""

__version__ = "0.1.0"

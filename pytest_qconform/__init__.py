"""pytest-qconform: the conformance test suite for 4-bit quantization backends.

Public API (stable; ``docs/downstream.md`` documents it):

- ``pytest_qconform.backends.base``: ``Backend``, ``Availability``, ``QuantSpec``,
  ``Capabilities``, ``Quantized`` (the adapter contract a backend implements).
- ``pytest_qconform.backends.registry``: ``ENTRY_POINT_GROUP`` (``"pytest_qconform.backends"``,
  where installed packages register backends), ``discover``, ``create``, ``UnknownBackendError``.
- ``pytest_qconform.backends.adapter_helpers``: ``import_failure``, ``dtype_name``,
  ``dtype_from_name``, ``to_numpy``, ``packed_bytes`` (what an adapter needs besides the contract).
- The hook ``pytest_qconform_backends(config)`` (``hookspecs``), for conftest.py backends.
- ``pytest_qconform.session.guests``: ``machine``, ``backend_available``, ``yield_the_cpu`` (what
  a backend's own pytest plugin may ask of a session).
- ``pytest_qconform.session.outcomes`` (defined in ``pytest_qconform.vocabulary``): the skip-reason
  prefixes ``NOT_CLAIMED_PREFIX``, ``UNAVAILABLE_PREFIX``, ``OOM_PREFIX`` (what a skip means in the matrix),
  and ``skip_not_claimed(reason)`` (a skip that says "no cell" as a value).
- ``pytest_qconform.reference``: the float64 reference, with ``reference.packed``
  (``PackedBnb4``, ``PackedHqq4``: the records ``Backend.export_packed`` returns).
- ``pytest_qconform.hardware.probe``: ``Probe``, ``probe_hardware``; ``pytest_qconform.hardware.archs``:
  ``KNOWN_ARCHS``, ``ArchFacts``, ``normalize_gcn_arch``, ``cuda_capability`` (the listed GPU archs).
- ``pytest_qconform.report.run_report``: ``read_report``, ``RunReport``, ``Cell`` (schema: docs/report-schema.md).
- ``pytest_qconform.report.sections``: ``Section``, ``ArchStatus``, ``read_section``, ``write_section`` (what a
  tool, not a run, puts into the matrix).
- The ``--qconform*`` options and ini settings, the markers, ``python -m pytest_qconform.matrix.cli``,
  ``python -m pytest_qconform doctor`` and ``python -m pytest_qconform check`` (``gate``).

Modules whose names start with an underscore, and ``plugin``, ``fixtures``, ``recorder``,
``setup``, ``state``, ``targets``, ``known_failures``, ``strategies`` and the rest of
``outcomes``, are internal. Our Triton backend (the qconform-triton-nf4 distribution in
triton-nf4/) uses only the names above (tests/test_package_imports.py holds it to that).
"""

__version__ = "0.1.0"

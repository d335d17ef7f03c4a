"""The run report: the record and its schema, atomic writes, tables, benchmark records, and the
CI gate that judges reports (``python -m pytest_qconform check``).
"""

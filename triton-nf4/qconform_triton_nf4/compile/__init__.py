"""The compile check: our Triton kernels compiled for every listed GPU arch on any machine, the
results the matrix reads (reports/compiled/) and the registers/occupancy table.
"""

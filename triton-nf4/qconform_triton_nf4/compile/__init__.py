"""The compile check: our Triton kernels compiled for every listed GPU arch on any machine, the
results (triton-nf4/compiled/), the matrix's section of them (reports/sections/) and the
registers/occupancy table.
"""

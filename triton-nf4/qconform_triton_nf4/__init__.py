"""Our Triton NF4 backend, one wing: the adapter, its ops, the kernels, the Triton mode set before
conftests import triton, the GPU warm-up and its kernel-call log.
"""

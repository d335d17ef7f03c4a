"""What a run runs on: the probe's frozen record, facts per arch (each with its source), and the
targets (device, arch) tests are parametrized over.
"""

"""The pytest session: hooks and options, session state, fixtures, the recorder, what an outcome
means, known failures and unsupported targets. plugin.py only wires hooks and delegates.
"""

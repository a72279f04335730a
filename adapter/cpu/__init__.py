"""What stands in for a GPU machine: import stand-ins, tiny models, the CPU server harness.

Used by tests, sims and `dsv41 canary` on CPU machines; never imported in production.
"""

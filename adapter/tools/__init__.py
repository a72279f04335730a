"""What an operator runs: the `dsv41` CLI and its commands (check, profile, canary, sims …).

Nothing in here is imported by the engine processes in production.
"""

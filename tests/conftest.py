"""Test-suite-wide settings."""

from hypothesis import settings

# Every property test draws the same examples on every run and machine: CI cannot fail by
# chance, and a failure reproduces with the same command. No example database is read or
# written, so a local run cannot replay examples CI never saw.
settings.register_profile("moeroute", derandomize=True, database=None, print_blob=True)
settings.load_profile("moeroute")

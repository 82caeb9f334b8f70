"""Generators of the golden suites in tests/data/golden/: each re-runs its host's reference code, from a checkout at
the commit the suite records, and writes the suite's case files (docs/testing.md, "Refreshing the golden suites")."""

"""Contract suites: pytest test classes every adapter of a port must pass.

Subclass the suite in your own tests and provide its fixtures; see docs/adding-a-backend.md.
This subpackage is the one place in ``ports`` that imports pytest (only when a suite is used).
"""

"""Test-support code that ships with the package, so tests and benches of other projects can reuse it.

Nothing here is imported by the converter itself.
"""

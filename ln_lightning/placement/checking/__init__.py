"""Checks: each rewritten block against the formula it should compute, with tolerances, black-box and isolation checks."""

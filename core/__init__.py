"""The bottom layer: what every other package shares, with no torch and no import of ours.

Errors with their status codes, the Drafter/Verifier interfaces the accept loop is written
against, sampling parameters and warping (numpy), the id and length checks every edge applies,
and the conventions of the wire.
"""

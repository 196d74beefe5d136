"""The ``specdec`` proto packages (``specdec.v1``: the wire contracts). See ``protos/build.py``."""

"""The wire contracts of specdec: ``.proto`` files (package ``specdec.v1``) and their generated
Python stubs, importable as ``protos.specdec.v1`` (built on first import; see ``protos/build.py``)."""

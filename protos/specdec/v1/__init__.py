"""Python stubs of the ``specdec.v1`` wire contracts (ARCHITECTURE.md, "Wire contracts").

Import the generated modules from here, e.g.::

    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc, verifier_pb2, verifier_pb2_grpc

Importing this package first makes sure the stubs are built and match the ``.proto`` files
(see ``protos/build.py``; ``python -m protos.build`` does the same by hand).
"""

from protos.build import ensure_stubs

ensure_stubs()

"""The wire contract shared by actors and the learner: ``coordinator.proto`` (package ``dapo.v1``).

Import the generated code as ``from protos import coordinator_pb2, coordinator_pb2_grpc``; the
one client of the service is ``actors.client.CoordinatorClient`` (actors, tools and tests).
Regenerate after editing the .proto with ``python -m protos.generate`` (tests/unit/test_protos.py
fails when the committed files are out of date).
"""

AUTH_METADATA_KEY = "x-dapo-token"
"""gRPC metadata key carrying the run's shared auth token on every call."""

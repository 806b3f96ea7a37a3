"""The training service (learner rank 0 hosts the coordinator, the replay queue and the weight
publisher; every rank trains). Imports ``dapo`` and ``protos``, never ``actors``."""

"""Weight transports, learner side: one sender per backend (``base.WeightSender``), by name.

A new backend is one file here and one line in SENDERS (and its receiver in ``actors/transports/``).
The gRPC FetchWeights stream needs no sender: learner/grpc_server.py serves it from the publisher's
version store (``WeightPublisher.info`` / ``read``).
"""

from learner.transports.base import SenderOptions, WeightSender, WeightSyncError
from learner.transports.collective import CollectiveSender
from learner.transports.side_channel import SideChannelSender

SENDERS: dict[str, type[WeightSender]] = {"side_channel": SideChannelSender, "collective": CollectiveSender}

__all__ = ["SENDERS", "SenderOptions", "WeightSender", "WeightSyncError"]

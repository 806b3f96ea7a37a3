"""Weight transports, learner side: the senders each backend (``weights.backend``) runs on rank 0.

SENDERS[name] lists the senders (``base.WeightSender``) the publisher fans each version out to;
``grpc_stream`` needs none: learner/grpc_server.py streams FetchWeights from the publisher's store.
A new backend is one file here and one line in SENDERS, its receiver in ``actors/transports/`` (one
file, one line in RECEIVERS) and its name in ``dapo.config.WEIGHT_BACKENDS`` (which the config checks).
"""

from learner.transports.base import SenderOptions, WeightSender, WeightSyncError
from learner.transports.collective import CollectiveSender
from learner.transports.cuda_ipc import CudaIpcSender
from learner.transports.side_channel import SideChannelSender

SENDERS: dict[str, tuple[type[WeightSender], ...]] = {
    "side_channel": (SideChannelSender,), "grpc_stream": (),
    # The side channel serves a joining actor's first weights and any version the broadcast missed.
    "collective": (SideChannelSender, CollectiveSender), "cuda_ipc": (SideChannelSender, CudaIpcSender)}

__all__ = ["SENDERS", "SenderOptions", "WeightSender", "WeightSyncError"]

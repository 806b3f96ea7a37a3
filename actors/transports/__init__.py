"""Weight transports, actor side: the receiving half of each backend of ``learner/transports/``.

RECEIVERS[RunParams.weight_backend] is the ``base.Follower`` an actor runs beside its network fetch
(``network.NetworkWeightClient`` over ``side_channel`` or ``grpc_stream``), every backend's fallback.
A new backend is one file here and one line in RECEIVERS, its sender in ``learner/transports/`` (one
file, one line in SENDERS) and its name in ``dapo.config.WEIGHT_BACKENDS``.
"""

from actors.transports.base import Follower
from actors.transports.collective import CollectiveFollower
from actors.transports.cuda_ipc import CudaIpcFollower

RECEIVERS: dict[str, type[Follower]] = {"side_channel": Follower, "grpc_stream": Follower,
                                        "collective": CollectiveFollower, "cuda_ipc": CudaIpcFollower}

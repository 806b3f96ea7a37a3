"""Weight transports, actor side: the receiving halves of ``learner/transports/``.

``network.NetworkWeightClient`` (side channel, or the FetchWeights stream when none is announced)
and ``collective.CollectiveWeightReceiver`` follow ``base.WeightReceiver``; ``side_channel`` and
``grpc_stream`` are their range readers (``base.RangeReader``, also the collective repair path).
"""

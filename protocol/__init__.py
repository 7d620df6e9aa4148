"""dflash.protocol: the wire (docs/PROTOCOL.md): message types, codec, sockets, CurveZMQ, credit
and the peer link. Process plumbing (config, logs, run folders, GPU) is runtime/."""

"""dflash.protocol: the wire (docs/PROTOCOL.md). Message types and limits, the codec (headers
and tensor frames, without socket I/O or batch policy), the fp8 encoding, ZeroMQ sockets,
CurveZMQ, credit, the target identity rule of the handshake, the named failures, and the
peer link. Process plumbing (config, logs, run folders, GPU, memory, threads) is runtime/."""

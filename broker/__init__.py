"""dflash.broker: the run's one broker (`dflash-broker`).

    core.py       BrokerCore: the run's state machine, no sockets; returns actions
    phase.py      the run's phase (running, job_lost, ending, draining, done) and how it ends
    inbound.py    typed structs of the messages the core consumes
    actions.py    what the core asks the server to do (send, close pipes, publish status)
    server.py     sockets, poller, I/O thread affinity, decoding, the relay; carries out actions
    control.py    what each control message does; lost and departed peers (called by the core)
    handshake.py  hello -> welcome / reject; run facts; consumer ranks and pipes
    intake.py     batches arriving on data in: validate, accept or drop as stale
    replies.py    refusals: reject answers and their log lines, rate-limited
    dispatch.py   the byte-bounded queue and credit dispatch
    leases.py     epochs, shuffled order, work leases
    lineage.py    which weights hold which trained batches (restarts from a checkpoint)
    ledger.py     SQLite (WAL) record of every (epoch, sample)
    liveness.py   timeouts, timers, rates, rate limits
    peers.py      peer sessions and IDs
    status.py     the status map and the progress line
    runinfo.py    run.json
    broker_command.py  the click command: options -> BrokerConfig -> broker_process.run
    broker_process.py  one broker process: create the run, serve it, record how it ended
"""

"""dflash.broker: the run's one broker (`dflash-broker`).

    server.py     sockets and the loop (read, dispatch, tick)
    control.py    what each control message does; lost and departed peers
    handshake.py  hello -> welcome / reject; run facts; consumer ranks and pipes
    intake.py     batches arriving on data in: validate, accept or drop as stale
    dispatch.py   the byte-bounded queue and credit dispatch
    leases.py     epochs, shuffled order, work leases
    ledger.py     SQLite (WAL) record of every (epoch, sample)
    liveness.py   timeouts, timers, rates, rate limits
    peers.py      peer sessions and IDs
    status.py     the status map and the progress line
    runinfo.py    run.json
    cli.py        the click command
"""

"""dflash.broker: the run's one broker (`dflash-broker`).

The server (every socket and every held batch's frames, the loop, the relay) decodes each
message to its type and calls the core's entry point for it; the core (no sockets, no
frames, no clock of its own) holds the run as a few parts, each the owner of its rules, and
returns actions for the server to carry out.

    server.py     sockets, poller, I/O thread affinity, decoding, the relay; carries out actions
    core.py       BrokerCore: the typed entry points, and what a message means across the parts
    inbound.py    what reaches the core: typed messages, refusals before a session, batches
    actions.py    what the core asks the server to do (send, open/close pipes, drop frames, publish)
  the parts:
    sessions.py   hello -> welcome / reject, pipes and ranks, heartbeats, who went silent
    work.py       work leases: grant, done, incomplete, given back
    intake.py     batches arriving on data in: validate, accept or drop as stale or misfit
    delivery.py   the queue, dispatch by credit, acks, requeues, quarantine
    commits.py    trained batches, commits, lineages
    facts.py      the run's target and dataset facts
    phase.py      the run's phase and how it ends
    status.py     the status map, the progress line, the broker's heartbeat figures
    replies.py    refusals: reject answers and their log lines, rate-limited
  their rules and records:
    peers.py, statements.py, handshake.py, dispatch.py, leases.py, lineage.py, fit.py,
    quarantine.py, ledger.py, liveness.py, runinfo.py, resume.py, diagnosis.py
    broker_command.py  the click command: options -> BrokerConfig -> broker_process.run
    broker_process.py  one broker process: create the run, serve it, record how it ended
"""

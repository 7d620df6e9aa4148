"""dflash.broker: the run's one broker (`dflash-broker`).

server.py owns every socket and frame and carries out what core.py's `BrokerCore` decides; the
core holds the run as parts (sessions, work, intake, delivery, commits, facts, phase, status,
replies), each the owner of its rules. docs/DESIGN.md's module map names every module.
"""

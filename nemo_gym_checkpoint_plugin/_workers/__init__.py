"""Servers with several uvicorn workers (``num_workers > 1``): one participant per server.

docs/protocol.md, "Several workers". A coordinator in the server's main process owns the
checkpoint state; each uvicorn worker talks to it over a Unix socket in the main process's
runtime directory. The pieces, lowest first:

- ``runtime_dir``: the per-process directory under ``/tmp`` that holds the sockets, and the
  sweep of directories left behind by dead servers;
- ``link``: framed request/reply messages over one Unix socket connection, both ways, with
  typed errors (``LinkError``) for a message that cannot be sent, a peer that disconnects
  and a reply that never comes;
- ``roster``: the coordinator's view of the workers (registration with the current state, losses,
  the readiness blockers they make, broadcasts);
- ``messages``: the op names and body shapes the two sides exchange;
- ``worker``: one worker's side (its admission and marks, its plugins answering the coordinator);
- ``coordinator``, ``fanout`` and ``restored``: the main process's side (the socket and
  registrations, the participant plugin fanning each hook out, the restored records until claimed);
- the wiring into a real server: ``service`` (the coordinator's thread and plane in Gym's main
  process), ``attach`` (a uvicorn worker's app: gate, claims, relayed closes) and ``forward``
  (control requests on the shared port, answered by the coordinator). ``_attach.attach_checkpointing``
  picks the side; ``wrap`` makes the module Gym's workers import its own.
"""

from __future__ import annotations

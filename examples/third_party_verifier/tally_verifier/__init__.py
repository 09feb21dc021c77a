"""tally-verifier: an example stateful Gym resources server (``app``) and its checkpoint plugin (``checkpoint``)."""

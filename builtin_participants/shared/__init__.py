"""What participants of several kinds share.

- ``attempts.py``: the attempts a retire names, by capture key;
- ``attempt_counts.py``: ``AttemptCounts``, counts per rollout and attempt for the lost-work ledger;
- ``reply_headers.py``: an ASGI middleware adding the protocol's headers to one route's replies;
- ``uncaptured_runs.py``: ``UncapturedRuns``, episodes no participant can capture (an agent's
  ``/run``, an environment without steps), listed as restarts;
- ``versions.py``: ``stamp`` and ``Same``, the versions of the participants' ``Versioned`` records.
"""

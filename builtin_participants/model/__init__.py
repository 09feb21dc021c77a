"""The model participant: model calls in flight, token-capture rows and generation cuts.

- ``calls.py``: ``ModelCalls``, the participant: the calls in flight, stopped by a retire;
  ``held_responses.py``: responses held while a checkpoint is open;
- ``model_records.py``: its records (an episode's owned rows and its cut) as ``api.Versioned`` ones;
- token capture (Gym's training-token rows): ``token_capture.py`` exports and installs them,
  ``capture_book.py`` says which rows this server owns, ``capture_rows.py`` reads a row,
  ``capture_files.py`` is the capture directory, ``capture_config.py`` the startup check that
  every capturing model server is a participant;
- generation cuts (a generation in flight continued from its tokens): ``cut_settings.py``,
  ``cut_book.py``, ``cut_stream.py``, ``cut_freeze.py``, ``cut_continue.py``, ``cut_parse.py``.
"""

"""Core hooks: behaviour the plugin itself ships as default plugins (``trylast``), replaceable by users.

Call order between plugins is never relied on for phases; these hooks are
``firstresult``: the first plugin that answers wins, and built-in defaults
answer last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_gym_checkpoint_plugin.markers import hookspec

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin.storage.local import LocalStorage


@hookspec(firstresult=True)
def storage_backend(name: str) -> LocalStorage | None:
    """Return the storage backend registered under ``name`` (``checkpoint.storage.backend``).

    Called once when a participant's control plane is built, before it serves. Return
    ``None`` when ``name`` is not yours. The backend must provide ``open_writer(checkpoint_dir,
    kind, instance, checkpoint_id)`` (an object with ``write(records, extras)`` and ``stop()``),
    ``read(checkpoint_dir, kind, instance, *, scope, validate)`` and
    ``read_manifest(checkpoint_dir, kind, instance)``, with the semantics of PROTOCOL.md's
    storage layout. Raising aborts startup. ``firstresult``: the first non-``None`` answer is
    used; the built-in ``local`` backend answers last.
    """

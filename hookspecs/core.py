"""Core hooks: behaviour the plugin itself ships as default plugins (``trylast``), replaceable by users.

Call order between plugins is never relied on for phases; these hooks are
``firstresult``: the first plugin that answers wins, and built-in defaults
answer last.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nemo_gym_checkpoint_plugin._markers import hookspec

if TYPE_CHECKING:
    from nemo_gym_checkpoint_plugin._settings import CheckpointSettings
    from nemo_gym_checkpoint_plugin._types import LeasePolicy
    from nemo_gym_checkpoint_plugin.api import StorageBackend


@hookspec(firstresult=True)
def storage_backend(name: str) -> StorageBackend | None:
    """Return the storage backend registered under ``name`` (``checkpoint.storage.backend``).

    Called once when a participant's control plane is built, before it serves. Return
    ``None`` when ``name`` is not yours. The backend implements ``api.StorageBackend``
    (``open_writer``, ``read``, ``read_manifest``) with the semantics of docs/protocol.md's
    on-disk format. Raising aborts startup. ``firstresult``: the first non-``None`` answer is
    used; the built-in ``local`` backend answers last. When no plugin answers, the server
    refuses to start (exit status 2) listing the names plugins declare in a
    ``storage_backend_names`` attribute: declare yours there.
    """


@hookspec(firstresult=True)
def lease_policy(settings: CheckpointSettings) -> LeasePolicy | None:
    """Return the ``LeasePolicy`` (grace after each call's deadline, self-resume retry interval).

    Called once when a participant's control plane is built, before it serves, with the
    validated ``checkpoint:`` block. The lease then runs to ``policy.expires_at(deadline_ts)``
    after every control call; when it expires the participant resumes on its own and retries
    every ``policy.retry_seconds`` after a failure. Raising aborts startup. ``firstresult``:
    the built-in default (``deadline_ts + lease_grace_seconds``, retry every 30 s) answers last.
    """


@hookspec(firstresult=True)
def coordination_order(operation: str) -> list[list[str]] | None:
    """Return the stages in which the controller calls participants for ``operation``.

    Called by the coordination library (controller side) once per fan-out; ``operation`` is
    one of ``prepare``, ``commit``, ``resume``, ``restore``, ``retire``, ``forget``,
    ``renew``. A stage is a list of kinds (``environment``, ``model``, ``agent``,
    ``resources``) called at once; stages run in order, and each kind appears exactly once.
    Return ``None`` for an operation you do not order. Raising fails the fan-out before any
    call is sent. ``firstresult``: the built-in orders of docs/protocol.md answer last.
    """

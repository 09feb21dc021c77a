"""The fake backend as an inference worker that stages training tokens itself (nemo-gym 0.7.0's external staging).

With ``token_id_capture.external_staging: true`` (backend ``vllm_worker``), Gym's model server
sends each admitted call's ``CaptureAdmission`` to the worker under ``ng_capture`` and asks for
token ids (``logprobs``, ``return_tokens_as_token_ids``). A worker with Gym's capture installed
stages the call's token delta in the training framework's storage, then acknowledges it with
``ng_commit_coords`` in its response; the model server then writes the call's ledger row
(``<key>.lineage.jsonl``). This module is that worker side, built on Gym's own
``RolloutTokenCapture`` and ``VLLMCaptureAdapter``:

- ``StagingDir`` is the framework's storage: a ``StagingSink`` and ``StagingSource`` over a
  directory, one JSON file per staged call (named by the sha256 of its staging key);
- ``stage_completion`` stages one completion when its request carries an admission: the prefix of
  a ``token_in`` call is its inline ``required_prefix_token_ids`` or, for a ``staging_chain``,
  the concatenated deltas of the chain's staged calls, as a real worker fetches them.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["StagingDir", "stage_completion"]


class StagingDir:
    """The training framework's staging storage, a directory (thread-safe: one file per call, written atomically)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path_for(self, staging_key: str) -> Path:
        return self.root / f"{hashlib.sha256(staging_key.encode()).hexdigest()}.json"

    def stage(self, record: Any, *, attachments: Mapping[str, Any] | None = None) -> Any:
        from nemo_gym.token_id_capture.staging import StageResult, staging_key

        if attachments:
            return StageResult(ok=False, error="the fake staging store keeps no attachments")
        self.root.mkdir(parents=True, exist_ok=True)
        key = staging_key(record.rollout_id, record.model_call_id)
        with tempfile.NamedTemporaryFile(dir=self.root, prefix=".staging-", delete=False) as handle:
            handle.write(record.model_dump_json().encode())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(handle.name, self.path_for(key))
        return StageResult(ok=True, staging_key=key)

    def fetch(self, staging_keys: list[str]) -> list[Any]:
        """One base snapshot (the record without its extras) per key, in order."""
        import orjson
        from nemo_gym.token_id_capture.staging import StagedCallBaseSnapshot

        snapshots = []
        for key in staging_keys:
            record = orjson.loads(self.path_for(key).read_bytes())
            record.pop("extras", None)
            snapshots.append(StagedCallBaseSnapshot.model_validate(record))
        return snapshots

    def prefix(self, staging_chain: list[str]) -> list[int]:
        """The token ids a ``staging_chain`` admission's prompt must begin with: every staged delta, in order."""
        return [token for snapshot in self.fetch(list(staging_chain)) for token in snapshot.token_ids_delta]


def stage_completion(
    body: Mapping[str, Any], completion: dict[str, Any], staging: StagingDir, worker_view: Any = None
) -> None:
    """Stage ``completion`` when ``body`` carries Gym's admission, and acknowledge it in ``completion``.

    ``worker_view`` makes the completion as the worker sees it (its prompt and generated token ids,
    whatever the request asked back), called only for an admitted call.
    """
    from nemo_gym.token_id_capture import NG_CAPTURE_FIELD, NG_COMMIT_COORDS_FIELD
    from nemo_gym.token_id_capture.adapters.vllm import VLLMCaptureAdapter
    from nemo_gym.token_id_capture.staging import CaptureAdmission, RolloutTokenCapture

    raw = body.get(NG_CAPTURE_FIELD)
    if raw is None:
        return
    admission = CaptureAdmission.model_validate(raw)
    capture = RolloutTokenCapture(sink=staging, weight_version_fn=lambda: 0, adapter=VLLMCaptureAdapter())
    prefix = None
    if admission.mode == "token_in" and not admission.required_prefix_token_ids:
        prefix = staging.prefix(admission.staging_chain)
    call = capture.begin_call(admission, prefix_token_ids=prefix)
    coords = capture.complete_call_from_response(call, worker_view(completion) if worker_view else completion)
    completion[NG_COMMIT_COORDS_FIELD] = coords.model_dump(mode="json")

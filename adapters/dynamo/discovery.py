"""Take a lost worker out of Dynamo's discovery at once.

A worker that dies without unregistering (killed, or its node lost) stays in discovery until
its registration expires; until then the frontend tries it again every few seconds and each
try costs a request a 503 and a retry (with etcd, for more than 25 s after a kill here). The
fleet knows sooner: it ends the registration itself.

Every key a worker registers (its instance and its model card) ends in its instance id, in
hex; with etcd they hang on one lease whose id is the instance id, so revoking it deletes them.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger(__name__)
_KEY_SEPARATOR = "%2F"  # file discovery: the key's slashes, escaped in its file name


def forget_instance(instance_id: int, *, etcd_endpoint: str | None = None,
                    file_kv: str | Path | None = None, timeout_s: float = 5.0) -> bool:
    """End the registration of Dynamo instance ``instance_id`` (etcd discovery at
    ``etcd_endpoint``, or the discovery folder ``file_kv``). True when something was removed."""
    if etcd_endpoint is not None:
        return _revoke_lease(etcd_endpoint, instance_id, timeout_s)
    if file_kv is not None:
        return _remove_files(Path(file_kv), instance_id)
    return False


def _revoke_lease(endpoint: str, lease_id: int, timeout_s: float) -> bool:
    # etcd's JSON gateway of its v3 API (int64 fields are strings there).
    request = urllib.request.Request(f"{endpoint.rstrip('/')}/v3/lease/revoke",
                                     data=json.dumps({"ID": str(lease_id)}).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read()
        return True
    except urllib.error.HTTPError as error:
        text = error.read().decode(errors="replace")
        if "lease not found" in text:  # it expired already
            return False
        raise


def _remove_files(folder: Path, instance_id: int) -> bool:
    suffixes = (f"{_KEY_SEPARATOR}{instance_id:x}", f"{_KEY_SEPARATOR}{instance_id:016x}")
    removed = False
    for path in folder.glob("v1/*/*"):
        if path.is_file() and path.name.endswith(suffixes):
            path.unlink(missing_ok=True)
            removed = True
    return removed

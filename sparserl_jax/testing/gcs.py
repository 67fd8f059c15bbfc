"""A Google Cloud Storage server on this machine, for tests of a `gs://` run directory.

`gcs_emulator()` starts `gcp-storage-emulator` (in memory, one bucket) on a free port and points
both clients a run uses at it: tensorstore's gcs driver (Orbax's arrays, the exchange) through
`TENSORSTORE_GCS_HTTP_URL`, gcsfs (`etils.epath`: Orbax's metadata, the ledger, the metrics)
through `STORAGE_EMULATOR_HOST`. Both read their variable once per process, so a process uses one
emulator; child processes inherit it. Not a faithful GCS: its conditional writes are not
atomic (the exchange's probe refuses it), so tests keep the exchange elsewhere. It omits the
`x-goog-generation` header on downloads, which tensorstore reads (Orbax's OCDBT manifests);
run as `python -m sparserl_jax.testing.gcs start ...`, this module adds it and starts it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from unittest import mock

from sparserl_jax.decoupled.launch import free_port

__all__ = ["gcs_emulator"]


@contextlib.contextmanager
def gcs_emulator(bucket: str = "sparserl-test", *, timeout_s: float = 60.0) -> Iterator[str]:
    """Run the emulator with `bucket` while the block runs; yields its URL. The variables that
    point clients at it are set in `os.environ` meanwhile (and restored after)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "sparserl_jax.testing.gcs", "start", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--in-memory", "--default-bucket", bucket]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {
        "TENSORSTORE_GCS_HTTP_URL": url,
        "STORAGE_EMULATOR_HOST": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",  # tensorstore sends it instead of real creds
    }
    # gcsfs warns on every filesystem it makes that it found no Google credentials.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start on port {port}") from None
                time.sleep(0.1)
        with mock.patch.dict(os.environ, env):
            yield url
    finally:
        server.kill()
        server.wait()


def _serve(argv: list[str]) -> None:
    """The emulator's command line, its downloads sending their object's generation."""
    from gcp_storage_emulator.handlers import objects

    plain = objects.download

    def download(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj["generation"])
        except Exception:  # noqa: BLE001 (a missing object: the plain handler says 404)
            pass
        return plain(request, response, storage, *args, **kwargs)

    objects.download = download  # before the server module builds its table of handlers
    from gcp_storage_emulator.__main__ import main

    main(argv)


if __name__ == "__main__":
    _serve(sys.argv[1:])

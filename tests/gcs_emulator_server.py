"""Runs ``gcp-storage-emulator`` with the object generation in download headers.

Cloud Storage answers every object download with ``x-goog-generation``;
TensorStore's OCDBT driver (Orbax's checkpoint format) reads it to update a
manifest conditionally. The emulator (2026.7.19) leaves it out, and TensorStore
then fails with "Malformed StorageGeneration" once a checkpoint has more than a
few arrays. This wrapper adds the header (and ``x-goog-metageneration``) before
the emulator builds its routes, then runs the emulator's own command line.

  python tests/gcs_emulator_server.py start --host 127.0.0.1 --port PORT ...
"""

from __future__ import annotations

import functools
import sys

from gcp_storage_emulator.handlers import objects


def _with_generation(download):
  @functools.wraps(download)
  def wrapped(request, response, storage, *args, **kwargs):
    try:
      obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
    except Exception:  # pylint: disable=broad-except  (404s are the handler's to answer)
      obj = None
    if obj is not None:
      response["x-goog-generation"] = str(obj.get("generation", "1"))
      response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))
    return download(request, response, storage, *args, **kwargs)
  return wrapped


objects.download = _with_generation(objects.download)

from gcp_storage_emulator.__main__ import main  # noqa: E402  (routes see the wrapper)

if __name__ == "__main__":
  main(sys.argv[1:])

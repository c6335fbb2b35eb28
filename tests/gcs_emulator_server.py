"""Runs ``gcp-storage-emulator`` with the object generation in download headers.

Cloud Storage answers every object download with ``x-goog-generation``;
TensorStore's OCDBT driver (Orbax's checkpoint format) reads it to update a
manifest conditionally. The emulator (2026.7.19) leaves it out, and TensorStore
then fails with "Malformed StorageGeneration" once a checkpoint has more than a
few arrays. This wrapper adds the header (and ``x-goog-metageneration``) before
the emulator builds its routes, then runs the emulator's own command line.

It also honours ``ifGenerationMatch`` on uploads and deletes (412 when the
object's generation differs; 0: the object must not exist), which the emulator
ignores: the run's workdir lease relies on it.

  python tests/gcs_emulator_server.py start --host 127.0.0.1 --port PORT ...
"""

from __future__ import annotations

import functools
import sys
from http import HTTPStatus

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


def _upload_name(request):
  """The object an upload names: in the query, else in its JSON metadata."""
  if request.query.get("name"):
    return request.query["name"][0]
  data = request.data if isinstance(request.data, dict) else {}
  return data.get("meta", data).get("name")


def _with_precondition(handler, name_of):
  @functools.wraps(handler)
  def wrapped(request, response, storage, *args, **kwargs):
    want = request.query.get("ifGenerationMatch")
    if want:
      try:
        obj = storage.get_file_obj(request.params["bucket_name"], name_of(request))
        have = str(obj.get("generation", "1"))
      except Exception:  # pylint: disable=broad-except  (no such object)
        have = "0"
      if have != want[0]:
        response.status = HTTPStatus.PRECONDITION_FAILED
        response.json(
          {
            "error": {
              "code": 412,
              "message": f"conditionNotMet: generation {have}, wanted {want[0]}",
            }
          }
        )
        return None
    return handler(request, response, storage, *args, **kwargs)

  return wrapped


objects.download = _with_generation(objects.download)
objects.insert = _with_precondition(objects.insert, _upload_name)
objects.delete = _with_precondition(objects.delete, lambda r: r.params["object_id"])

from gcp_storage_emulator.__main__ import main  # noqa: E402  (routes see the wrapper)

if __name__ == "__main__":
  main(sys.argv[1:])

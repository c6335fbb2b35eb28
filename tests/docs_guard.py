"""``refuse_docs(monkeypatch)``: from then on every ``open()`` of a file under docs/ fails
the test (``make demo`` and the recorded studies' summaries read nothing from docs/)."""

from __future__ import annotations

import builtins
import io
import pathlib
from collections.abc import Callable
from typing import Any

import pytest

DOCS = (pathlib.Path(__file__).resolve().parent.parent / "docs").resolve()


def refuse_docs(monkeypatch: pytest.MonkeyPatch) -> None:
  """Patches ``builtins.open`` and ``io.open`` until ``monkeypatch`` is undone."""

  def guarded(open_fn: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(file: Any, *args: Any, **kwargs: Any) -> Any:
      if isinstance(file, (str, pathlib.Path)) and DOCS in pathlib.Path(file).resolve().parents:
        raise AssertionError(f"read {file} from docs/")
      return open_fn(file, *args, **kwargs)

    return refuse

  monkeypatch.setattr(builtins, "open", guarded(builtins.open))
  monkeypatch.setattr(io, "open", guarded(io.open))

"""One parse of a GGUF file per import: the importer's checks and gguf2mlx's converter share it.

`gguf`'s `GGUFReader` decodes every metadata field when it opens a file, a Python loop over each
string of the tokenizer's vocabulary and merges: about 5 s of a CPU for SmolLM2-135M's 49k tokens,
more for larger vocabularies. gguf2mlx opens the file itself twice (its multimodal check, then the
conversion), and the importer once before them to refuse what it cannot convert; so the converter is
handed the importer's reader instead of opening the file again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from ..errors import ModelImportError


def read_gguf(gguf: Path) -> Any:
    """`gguf`'s reader of the file, its metadata parsed; a file that is not GGUF fails in one line."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf))
    except Exception as exc:  # gguf raises bare ValueError/struct errors on bad files
        raise ModelImportError(f"{gguf}: cannot read it as GGUF ({exc})") from None


@contextlib.contextmanager
def reused(reader: Any, gguf: Path) -> Iterator[None]:
    """gguf2mlx opening `gguf` gets `reader` instead of parsing the file again (any other file is opened
    as usual). The reader is only read from: gguf2mlx takes metadata and tensor views from it."""
    from gguf2mlx import gguf2mlx as core

    opened = core.GGUFReader

    def open_reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(path) == gguf:
            return reader
        return opened(path, *args, **kwargs)

    with mock.patch.object(core, "GGUFReader", open_reader):
        yield

"""The state folder, `$MLX_SUBAGENTS_HOME` (default `~/.mlx-subagents`): saved runs, user agents, workflows.

One place reads the environment variable, so every module agrees on where the folder is, and one
place creates folders in it, so a home that is a file or read-only is one line, not a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import StateHomeError
from .userfiles import os_reason

HOME_ENV = "MLX_SUBAGENTS_HOME"
DEFAULT_HOME = "~/.mlx-subagents"


def state_home() -> Path:
    """`$MLX_SUBAGENTS_HOME`, default `~/.mlx-subagents`."""
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def make_state_dir(path: Path, *, home: Path | None = None, exist_ok: bool = True) -> Path:
    """Create `path` (and its parents) inside the state folder; one `StateHomeError` line if that fails.

    Args:
        home: the state folder `path` lies in, named in the error (default `state_home()`).
    """
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except OSError as exc:
        where = home or state_home()
        raise StateHomeError(
            f"cannot save in the state folder {where}: {os_reason(exc)}; set {HOME_ENV} to a writable folder"
        ) from None
    return path

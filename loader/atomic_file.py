"""Files written whole or not at all: write to a temporary name beside the target, rename over it at the
end (atomic on POSIX and Windows), delete the temporary file if anything fails on the way."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def written_whole(path):
    """Yields the temporary path (str) to write; on a normal exit it becomes `path`."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.partial"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)

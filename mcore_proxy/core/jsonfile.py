"""Reading a JSON object that a stranger may have written: one function, one set of failure messages.

Config files, plans, statistics sidecars and signature libraries all come from outside. Each
defect (missing, unreadable, not UTF-8, not JSON, nested past the recursion limit, absurdly large,
not an object) becomes one sentence naming the file and the fix, raised as the caller's error class
so the CLI exits 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcore_proxy.core.errors import ProxyError

MAX_JSON_BYTES = 256 << 20  # far beyond any real config, plan or library; refuse before reading


def read_json_object(
    path: str | Path,
    what: str,
    fix: str,
    error: type[ProxyError] = ProxyError,
    missing_fix: str | None = None,
    limit: int = MAX_JSON_BYTES,
) -> dict:
    """The JSON object in `path`.

    what: the file's role in messages ("plan file", "campaign file"); fix: the remedy appended to
    every message ("regenerate it with `mcore-proxy select`"); missing_fix: the remedy when the
    file does not exist (default `fix`). Raises `error` (a ProxyError) naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise error(f"{path}: {what} is {size} bytes, far beyond any real one; {fix}")
        text = path.read_bytes().decode("utf-8")
        data = json.loads(text)
    except FileNotFoundError:
        raise error(f"{path}: {what} not found; {missing_fix or fix}") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, expected a {what}; pass the {what} itself, not a folder") from None
    except OSError as err:
        raise error(f"{path}: {what} cannot be read ({err.strerror or err}); {fix}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: absurd nesting
        raise error(f"{path}: {what} is not valid JSON ({str(err)[:80]}); {fix}") from None
    except ProxyError:  # the size check above (ProxyError is a ValueError)
        raise
    except ValueError:  # an integer literal longer than Python's int parsing limit (4300 digits)
        raise error(f"{path}: {what} holds a number of thousands of digits, which no real one does; {fix}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: {what} holds a JSON {type(data).__name__}, expected an object; {fix}")
    return data

"""`CallbackHandle`: a removable attachment that is not a torch hook (a wrapper installed on an
instance, a callback in a chain), with the API of torch's hook handles. Shared by the fault
injectors and the engine hooks (`engines/`)."""

from __future__ import annotations


class CallbackHandle:
    """Calls `remove` once, on the first `.remove()`."""

    def __init__(self, remove):
        self._remove = remove

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

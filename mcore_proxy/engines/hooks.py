"""The one owner of hook handles: every hook mcore-proxy puts on a model (a torch forward hook, a
step hook, or a `CallbackHandle` for an attachment that is not a torch hook) is held by a `Hooks`
and removed by it, once, in reverse order. The trace, the fault injectors, the restricted and
replayed routers, the functional runs and the rollout engine's observers all hold theirs here.
"""

from __future__ import annotations


class CallbackHandle:
    """A removable attachment that is not a torch hook (a wrapper installed on an instance, a
    callback in a chain), with the API of torch's hook handles: calls `remove` once, on the first
    `.remove()`."""

    def __init__(self, remove):
        self._remove = remove

    def remove(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None


class Hooks:
    """Handles owned together: `forward` registers a forward hook and keeps its handle, `add` keeps
    handles made elsewhere, `remove` removes them all (newest first; idempotent). A context manager
    that removes on exit."""

    def __init__(self):
        self._handles: list = []

    def add(self, *handles) -> None:
        self._handles.extend(handles)

    def forward(self, module, fn, *, with_kwargs: bool = False):
        """`module.register_forward_hook(fn)`, owned here; returns the handle."""
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs)
        self._handles.append(handle)
        return handle

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def __len__(self) -> int:
        return len(self._handles)

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

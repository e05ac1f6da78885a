"""STAND-IN for `mindspeed.patch_utils`: the minimal registration API of MindSpeed's patch manager.

Behaviour imitated from MindSpeed (mindspeed/patch_utils.py): `register_patch(name, func)` stores
`func` as the replacement of the dotted `name`, unless `func.__name__` ends in "wrapper" or
"decorator", in which case it is stored as a wrapper; `apply_patches()` resolves the target
(importing its module), builds `final = replacement or original`, applies every wrapper in
registration order, `final = wrapper(final)`, and sets the attribute. A second replacement
without `force_patch` is an error, as in MindSpeed. Nothing else of MindSpeed is imitated.
"""

import importlib


class Patch:
    def __init__(self, orig_func_name, new_func):
        self.orig_module_name, self.orig_func_name = orig_func_name.rsplit(".", 1)
        self.patch_func, self.wrappers, self.is_applied = None, [], False
        self.set_patch_func(new_func)

    def set_patch_func(self, new_func, force_patch=False):
        if new_func.__name__.endswith(("wrapper", "decorator")):
            if new_func not in self.wrappers:
                self.wrappers.append(new_func)
        else:
            if self.patch_func is not None and not force_patch:
                raise RuntimeError(f"the patch of {self.orig_func_name} exist !")
            self.patch_func = new_func
        self.is_applied = False

    def apply_patch(self):
        if self.is_applied:
            return
        owner = _resolve(self.orig_module_name)
        final = self.patch_func or getattr(owner, self.orig_func_name)
        for wrapper in self.wrappers:
            final = wrapper(final)
        setattr(owner, self.orig_func_name, final)
        self.is_applied = True


def _resolve(dotted):
    """Longest importable module prefix, then attributes (a class, for methods)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


class MindSpeedPatchesManager:
    patches_info = {}

    @staticmethod
    def register_patch(orig_func_name, new_func=None, force_patch=False, create_dummy=False):
        if orig_func_name not in MindSpeedPatchesManager.patches_info:
            MindSpeedPatchesManager.patches_info[orig_func_name] = Patch(orig_func_name, new_func)
        else:
            MindSpeedPatchesManager.patches_info[orig_func_name].set_patch_func(new_func, force_patch)

    @staticmethod
    def apply_patches():
        for patch in MindSpeedPatchesManager.patches_info.values():
            patch.apply_patch()

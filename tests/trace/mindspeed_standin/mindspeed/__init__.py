"""STAND-IN for MindSpeed, used only by the tests: mindspeed and torch_npu cannot be installed.

Only `mindspeed.patch_utils.MindSpeedPatchesManager`'s registration API is imitated (see there).
"""

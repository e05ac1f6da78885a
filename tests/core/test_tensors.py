"""HostTensor moves the same bytes as torch for every operation the convert path uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_proxy.core.tensors import HostTensor, cast, cat, empty, host_tensors, is_tensor, stack


def _pair(shape, dtype: torch.dtype, seed: int = 0):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    raw = t.view(torch.uint8).numpy().copy() if t.element_size() == 1 else None
    array = raw if raw is not None else t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy().copy()
    return t, HostTensor(array, str(dtype)[6:])


def _same(h: HostTensor, t: torch.Tensor) -> None:
    assert tuple(h.shape) == tuple(t.shape) and h.dtype_name == str(t.dtype)[6:]
    assert h.contiguous().array.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes()
    assert torch.equal(h.torch().view(torch.uint8), t.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_the_operations_of_the_convert_path_match_torch(dtype):
    t, h = _pair((6, 4), dtype)
    _same(h, t)
    _same(h[[4, 1, 2]].clone(), t[[4, 1, 2]].clone())  # router rows in plan order
    _same(h[..., [3, 0]].clone(), t[..., [3, 0]].clone())  # bias entries
    _same(h.narrow(1, 1, 2).clone(), t.narrow(1, 1, 2).clone())
    _same(h.t().contiguous(), t.t().contiguous())
    _same(h.reshape(3, -1), t.reshape(3, -1))
    _same(h.view(2, 3, 4)[:, 1:], t.view(2, 3, 4)[:, 1:])
    for hc, tc in zip(h.chunk(4), t.chunk(4)):  # 6 rows in 4 chunks: torch's sizes 2, 2, 2
        _same(hc, tc)
    _same(cat([h[:2], h[3:]], dim=0), torch.cat([t[:2], t[3:]], dim=0))
    _same(cat([h, h], dim=1), torch.cat([t, t], dim=1))
    _same(stack([h.t(), h.t()]), torch.stack([t.t(), t.t()]))
    flat = h.reshape(-1)
    _same(flat.as_strided((4, 6), (1, 4)).clone(), t.reshape(-1).as_strided((4, 6), (1, 4)).clone())


def test_integer_casts_stay_on_the_host_and_others_go_through_torch():
    ids = HostTensor(np.array([5, -1, 3], dtype=np.int64), "int64")
    small = cast(ids, "int32")
    assert isinstance(small, HostTensor) and small.array.dtype == np.int32 and small.array.tolist() == [5, -1, 3]
    _, h = _pair((3,), torch.float32)
    as_bf16 = cast(h, "bfloat16")
    assert isinstance(as_bf16, torch.Tensor) and as_bf16.dtype == torch.bfloat16


def test_a_mix_of_host_and_torch_tensors_is_joined_by_torch():
    t, h = _pair((2, 3), torch.bfloat16)
    joined = cat([h, t])
    assert isinstance(joined, torch.Tensor) and torch.equal(joined, torch.cat([t, t]))


def test_empty_follows_the_mode():
    assert isinstance(empty((0,), "uint8"), torch.Tensor)
    with host_tensors():
        inside = empty((0,), "uint8")
        with host_tensors(False):
            assert isinstance(empty((2,), "bfloat16"), torch.Tensor)
        assert isinstance(empty((2,), "bfloat16"), HostTensor)
    assert isinstance(inside, HostTensor) and inside.numel() == 0 and is_tensor(inside)
    assert isinstance(empty((1,), "float32"), torch.Tensor)

"""How well a kept set reproduces the original MoE layer's output on calibration points.

The calibration points of a layer are its live experts' routed-context prototypes (mean router
input of the tokens routed to expert m, `proto_sum[m] / freq[m]`, which the trace already
records), weighted by how often m was selected. At each point the original layer computes
`y(x) = sum over its top-k experts e of p_e(x) E_e(x)` and the proxy, whose router may only
choose kept experts, `y_S(x)` with the same rule over the kept logits. The reconstruction error

    R(S) = sum_m f_m ||y(x_m) - y_S(x_m)||^2 / sum_m f_m ||y(x_m)||^2

is what a proxy changes in that layer's output (the shared experts and everything else are
identical and cancel). Routing follows megatron-core's TopKRouter without group limits: softmax
scores taken over the top-k logits (pre-softmax off, Megatron's default) or sigmoid scores with
the expert bias added for the choice only and the chosen scores normalised (top-k > 1).
Experts are SwiGLU (`--swiglu`), GELU-gated or GELU MLPs (`ModelSpec.activation`), weights as in
DESIGN.md 4.3.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcore_proxy.core.errors import PlanError
from mcore_proxy.mcore.spec import layer_module_prefix


def as_float64(w) -> np.ndarray:
    """A torch tensor or array as float64 numpy (bf16 has no numpy dtype: converted in torch)."""
    if hasattr(w, "detach"):  # a torch tensor; bf16 has no numpy dtype, so convert in torch
        import torch

        return w.detach().to(dtype=torch.float64, device="cpu").numpy()
    return np.asarray(w, dtype=np.float64)


def expert_weight_names(layer_id: str, expert: int) -> tuple[str, str]:
    prefix = f"{layer_module_prefix(layer_id)}.mlp.experts.{expert}"
    return f"{prefix}.linear_fc1.weight", f"{prefix}.linear_fc2.weight"


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _gelu(x):
    import torch  # erf-exact GELU, as torch.nn.functional.gelu (Megatron's default activation)

    return torch.nn.functional.gelu(torch.from_numpy(x)).numpy()


def expert_outputs(points: np.ndarray, fc1: np.ndarray, fc2: np.ndarray, activation: str) -> np.ndarray:
    """One expert applied to points [P, H] -> [P, H]. fc1 [2F, H] (gate rows, then up rows) for
    the gated activations "swiglu" (SiLU gate, Megatron `--swiglu`) and "geglu" (GELU gate),
    [F, H] for "gelu"; fc2 [H, F]."""
    h = points @ fc1.T
    if activation == "gelu":
        h = _gelu(h)
    else:
        gate, up = np.split(h, 2, axis=1)
        h = (_silu(gate) if activation == "swiglu" else _gelu(gate)) * up
    return h @ fc2.T


@dataclass(frozen=True, repr=False)
class LayerFunction:
    """One MoE layer evaluated at P calibration points.

    logits [P, E] router logits; outputs [P, E, H] every expert's output at every point;
    weights [P] point weights (selection counts); bias [E] expert bias or None."""

    logits: np.ndarray
    outputs: np.ndarray
    weights: np.ndarray
    topk: int
    score_function: str = "softmax"
    bias: np.ndarray | None = None

    def output(self, kept=None) -> np.ndarray:
        """Layer output [P, H] with routing restricted to `kept` (None: all experts)."""
        logits = self.logits
        E = logits.shape[1]
        allowed = np.ones(E, dtype=bool) if kept is None else np.isin(np.arange(E), list(kept))
        if self.score_function == "sigmoid":
            scores = 1.0 / (1.0 + np.exp(-logits))
            choice = scores + (self.bias if self.bias is not None else 0.0)
        else:
            scores, choice = logits, logits
        choice = np.where(allowed, choice, -np.inf)
        top = np.argpartition(-choice, self.topk - 1, axis=1)[:, : self.topk]  # [P, k]
        picked = np.take_along_axis(scores, top, axis=1)
        if self.score_function == "sigmoid":
            probs = picked / (picked.sum(1, keepdims=True) + 1e-20) if self.topk > 1 else picked
        else:
            picked = picked - picked.max(1, keepdims=True)
            probs = np.exp(picked) / np.exp(picked).sum(1, keepdims=True)
        rows = np.arange(logits.shape[0])[:, None]
        return np.einsum("pk,pkh->ph", probs, self.outputs[rows, top])

    def error(self, kept) -> float:
        """R(S): weighted squared output error of the kept set relative to the output's energy."""
        ref = self._reference
        diff = ((ref - self.output(kept)) ** 2).sum(1)
        return float((self.weights * diff).sum() / max(self._energy, 1e-300))

    @property
    def _reference(self) -> np.ndarray:
        ref = self.__dict__.get("_ref")
        if ref is None:
            ref = self.output(None)
            object.__setattr__(self, "_ref", ref)
            object.__setattr__(self, "_energy", float((self.weights * (ref**2).sum(1)).sum()))
        return ref


def layer_function(view, layer_id: str, stats_layer, router_weight: np.ndarray) -> LayerFunction:
    """The LayerFunction of `layer_id` from a ModelView (expert and router weights, spec) and the
    layer's statistics (prototypes and frequencies). Reads every expert of the layer once, one
    expert at a time; holds P x E x H float32 outputs (P live experts: 2 MiB at E=64, H=128;
    1.9 GiB for a DeepSeek-V3 layer, E=256, H=7168)."""
    if not hasattr(view, "spec") or not hasattr(view, "get"):
        raise PlanError("reconstruction needs the checkpoint's expert weights; pass a ModelView")
    spec = view.spec
    names = set(view.names())
    missing = [n for n in expert_weight_names(layer_id, 0) if n not in names]
    if missing:
        raise PlanError(
            f"the checkpoint has no {missing[0]}; reconstruction reads every expert's "
            "weights: select from the full checkpoint or choose a method without it"
        )
    freq = stats_layer.freq
    live = np.flatnonzero(freq > 0)
    points = stats_layer.proto_sum[live] / freq[live, None]
    outputs = np.empty((live.size, spec.num_experts, spec.hidden_size), dtype=np.float32)
    activation = view.spec.activation
    for e in range(spec.num_experts):
        fc1_name, fc2_name = expert_weight_names(layer_id, e)
        fc1, fc2 = as_float64(view.get(fc1_name)), as_float64(view.get(fc2_name))
        outputs[:, e] = expert_outputs(points, fc1, fc2, activation)
    bias = None
    if spec.expert_bias:
        from mcore_proxy.mcore.spec import expert_bias_name

        bias = as_float64(view.get(expert_bias_name(layer_id)))
    return LayerFunction(
        points @ router_weight.T, outputs, freq[live].astype(np.float64), spec.topk, spec.score_function, bias
    )

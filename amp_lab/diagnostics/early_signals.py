"""Signals that come before the loss diverges, as device tensors read at log steps.

- per attention block, every step, a bound on its largest logit, scale x max|q| x max|k| (read
  at timm's `q_norm`, `k_norm`), and at probe steps the exact one (Wortsman et al. 2023);
- the kurtosis of each block's output features (He et al. 2024; FOG, arXiv 2505.20524);
- per weight matrix, the RMS of Adam's g^2 / v-hat (StableAdamW, arXiv 2304.13013);
- the share of the 16-bit weights' updates that rounding erased (no masters, nearest rounding);
- once: eps against its state dtype, lr x weight decay against the weights'.

The rule table (amp_lab/health/rules.py) judges them against `health.*`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from amp_lab.components.fsdp import local
from amp_lab.diagnostics.module_probe import Hooks, running_max

BLOCK_CLASSES = ("Bottleneck", "BasicBlock")  # timm blocks whose class name lacks "Block"
SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def _is_block(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("Block") or name in BLOCK_CLASSES


def feature_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """mean(s^2) / mean(s)^2 of the per-feature mean squares s (He et al. 2024): 1 when every
    feature carries the same energy, up to the feature count when one feature carries it all."""
    x = x.detach().float()
    dims = [d for d in range(x.dim()) if d != (1 if x.dim() == 4 else x.dim() - 1)]
    s = x.square().mean(dim=dims)  # channels of an NCHW map, the last dim of tokens
    return s.square().mean() / s.mean().square().clamp_min(1e-30)


class BlockSignals(Hooks):
    """Forward hooks: per attention block its logit bound (every step once `watch()`ed), and on
    probe steps (`attach()` to `detach()`) its exact largest logit and each block's kurtosis."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.attention = [
            (name, m)
            for name, m in model.named_modules()
            if all(hasattr(m, a) for a in ("q_norm", "k_norm", "scale"))
        ]
        self.blocks = [(name, m) for name, m in model.named_modules() if name and _is_block(m)]
        self.handles: list[torch.utils.hooks.RemovableHandle] = []  # the probe step's
        self.watching: list[torch.utils.hooks.RemovableHandle] = []  # every step's
        self.probing = False
        self.q: torch.Tensor | None = None  # the last q_norm output, read by the next k_norm
        self.values: dict[str, list[torch.Tensor]] = {"bound": [], "logit": [], "kurtosis": []}
        self.seen: dict[str, torch.Tensor] = {}  # per kind: the max per module since the read

    def _attention_hooks(self) -> list[torch.utils.hooks.RemovableHandle]:
        return [
            handle
            for _, attn in self.attention
            for handle in (
                attn.q_norm.register_forward_hook(self._keep_q),
                attn.k_norm.register_forward_hook(self._logits(attn.scale)),
            )
        ]

    def watch(self) -> None:
        """The bound on every step from now on."""
        self.watching = self.watching or self._attention_hooks()

    def attach(self) -> None:
        """A probe step: the exact logits and the kurtosis too."""
        if self.probing:
            return
        self.probing = True
        self.handles = [] if self.watching else self._attention_hooks()
        self.handles += [block.register_forward_hook(self._kurtosis) for _, block in self.blocks]

    def detach(self) -> None:
        super().detach()
        self.probing = False

    def _keep_q(self, module: torch.nn.Module, args: Any, q: torch.Tensor) -> None:
        self.q = q

    def _logits(self, scale: float):
        def hook(module: torch.nn.Module, args: Any, k: torch.Tensor) -> None:
            if not module.training or self.q is None:
                return
            q, self.q = self.q, None
            with torch.no_grad():  # no graph, and no detach op of its own
                # |q.k| <= |q| |k|: four reductions over [batch, heads, tokens], far cheaper
                # than the logits; fp32 norms, whose squares would overflow fp16
                q_max, k_max = (
                    torch.linalg.vector_norm(t, dim=-1, dtype=torch.float32).amax() for t in (q, k)
                )
                self.values["bound"].append(q_max * k_max * scale)
                if self.probing:  # fp32 product: the logits before any rounding of their own
                    logits = (q.float() * scale) @ k.float().transpose(-2, -1)
                    self.values["logit"].append(logits.amax())

        return hook

    def _kurtosis(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training and torch.is_tensor(output) and output.is_floating_point():
            self.values["kurtosis"].append(feature_kurtosis(output))

    def end_step(self) -> None:
        """Stack this step's values (device ops) into the maxima since the last read."""
        for kind, values in self.values.items():
            if values:
                self.seen[kind] = running_max(self.seen.get(kind), torch.stack(values))
                values.clear()

    def read(self) -> dict[str, Any]:
        """`diag/` keys (a sync): the largest logit bound, logit and kurtosis, and their blocks."""
        attention, blocks = [n for n, _ in self.attention], [n for n, _ in self.blocks]
        record: dict[str, Any] = {}
        for kind, key, names in (
            ("bound", "attn_logit_bound", attention),
            ("logit", "attn_logit_max", attention),
            ("kurtosis", "kurtosis_max", blocks),
        ):
            seen = self.seen.pop(kind, None)
            if seen is None or len(seen) != len(names):
                continue
            top = int(torch.nan_to_num(seen, nan=torch.inf).argmax())
            record[f"diag/{key}"] = float(seen[top])
            record[f"diag/{key}_block"] = names[top]
        return record


def adam_rms(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, list[int]] | None:
    """Per weight matrix with a gradient (FSDP: this rank's shards), RMS of g^2 / max(v-hat,
    eps^2) after the step as StableAdamW measures it, with their indices in the param groups."""
    values, index = [], []
    params = [(group, p) for group in optimizer.param_groups for p in group["params"]]
    for i, (group, p) in enumerate(params):
        beta2, eps = group.get("betas", (0.0, 0.999))[1], group.get("eps", 1e-8)
        state = optimizer.state.get(p, {})
        v = state.get("exp_avg_sq")
        if v is None or p.grad is None or p.dim() < 2:  # biases and norms: a few values
            continue
        v = local(v.dequantize() if getattr(v, "codes", None) is not None else v)  # torchao
        step = torch.as_tensor(state.get("step", 1), device=v.device, dtype=torch.float32)
        v_hat = v.float() / (1 - beta2**step).clamp_min(1e-30)
        ratio = local(p.grad).detach().float().square() / v_hat.clamp_min(eps * eps)
        values.append(ratio.mean().sqrt())
        index.append(i)
    return (torch.stack(values), index) if values else None


def erased_counts(
    before: Sequence[torch.Tensor], delta: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> torch.Tensor | None:
    """[erased, updated]: the 16-bit elements with a nonzero gradient that the step left as is."""
    low = [i for i, w in enumerate(before) if w.dtype in SIXTEEN_BIT]
    if not low:
        return None
    moved = [(grads[i] != 0) for i in low]
    erased = [(delta[i] == 0) & m for i, m in zip(low, moved)]
    return torch.stack(
        [torch.stack([e.sum() for e in erased]).sum(), torch.stack([m.sum() for m in moved]).sum()]
    )


def optimizer_floors(optimizer: torch.optim.Optimizer, rounding: str | None) -> dict[str, Any]:
    """Config-time facts (once the state exists): the smallest eps against its dtype's smallest
    value; the largest peak lr x wd against the spacing of 16-bit weights rounded to nearest."""
    record: dict[str, Any] = {}
    eps = [
        (float(g["eps"]), s.dtype)
        for g in optimizer.param_groups
        if "eps" in g
        for p in g["params"]
        if torch.is_tensor(s := optimizer.state.get(p, {}).get("exp_avg_sq"))
        and s.dtype.is_floating_point
    ]
    if eps:
        value, dtype = min(eps, key=lambda e: e[0] / _smallest_positive(e[1]))
        record["diag/eps"] = value
        record["diag/eps_floor"] = _smallest_positive(dtype)
        record["diag/eps_dtype"] = str(dtype).replace("torch.", "")
    if rounding in ("stochastic", "kahan"):
        return record  # those carry the small decays on: in expectation, or in the compensation
    decays = [
        # float(): torchao's low-bit optimizers keep lr as a tensor
        (float(g.get("initial_lr", g["lr"])) * g["weight_decay"], p.dtype)
        for g in optimizer.param_groups
        if g.get("weight_decay", 0) > 0
        for p in g["params"]
        if p.dtype in SIXTEEN_BIT
    ]
    if decays:
        value, dtype = max(decays, key=lambda d: d[0] / torch.finfo(d[1]).eps)
        record["diag/lr_wd"] = value
        # w (1 - lr wd) rounds back to w when lr wd is below half an ulp of 1: eps / 2
        record["diag/lr_wd_floor"] = torch.finfo(dtype).eps / 2
        record["diag/lr_wd_dtype"] = str(dtype).replace("torch.", "")
    return record


def _smallest_positive(dtype: torch.dtype) -> float:
    """The smallest subnormal of a float dtype: anything below half of it rounds to 0."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def low_precision_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's 16-bit weights (the pure modes'), detached, not copied."""
    return [p.detach() for p in model.parameters() if p.dtype in SIXTEEN_BIT]


def since_start(model: torch.nn.Module, start: list[torch.Tensor]) -> dict[str, float | None]:
    """The 16-bit weights against `start` (a sync): the share unmoved and the L2 norms' ratio."""
    now = low_precision_weights(model)
    if not start or len(now) != len(start):
        return {"unmoved_share": None, "weight_norm_ratio": None}
    same = torch.stack([(a == b).sum() for a, b in zip(now, start)]).sum()
    norms = [
        torch.linalg.vector_norm(torch.stack(torch._foreach_norm(t, dtype=torch.float32)))
        for t in (now, start)
    ]
    return {
        "unmoved_share": float(same) / sum(t.numel() for t in start),
        "weight_norm_ratio": float(norms[0] / norms[1]),
    }

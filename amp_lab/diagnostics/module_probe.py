"""Per-module max |x| of activations and input-gradients, and the first module to go non-finite.

While attached, forward hooks record max |output| and tensor hooks max |input-gradient|, as
device tensors; per phase, a device-side record keeps the first step that held an inf/nan, read
on the host only at log steps. Assumes the same modules run in the same order every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    """Floating tensors inside a module's output or inputs (tuples and lists one level deep)."""
    items = value if isinstance(value, (tuple, list)) else [value]
    return [t for t in items if torch.is_tensor(t) and t.is_floating_point() and t.numel() > 0]


def _max_abs(t: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 device scalar, inf and nan propagating; one aminmax: torch's inf-norm
    kernel is an order of magnitude slower on a CPU (docs/benchmarks.md)."""
    low, high = torch.aminmax(t.detach())
    return torch.maximum(high, low.neg()).float()


def running_max(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The element-wise max so far (nan propagates); `new` alone when the calls changed."""
    return new if old is None or old.shape != new.shape else torch.maximum(old, new)


class FirstNonFinite:
    """Device-side record of the first step at which some value of a phase was inf/nan."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step = torch.full((), -1, dtype=torch.long, device=device)  # -1 until captured
        self.index = torch.zeros((), dtype=torch.long, device=device)  # its first bad call
        self.value = torch.zeros((), device=device)  # that call's max |x| (inf or nan)
        self.history: list[tuple[int, list]] = []  # (from step, call names)

    def update(self, values: torch.Tensor, names: list[tuple[str, str]], step: int) -> None:
        bad = ~torch.isfinite(values)
        new = (self.step < 0) & bad.any()
        first = bad.int().argmax()  # the first True, in call order
        self.index = torch.where(new, first, self.index)
        self.value = torch.where(new, values[first], self.value)
        self.step.masked_fill_(new, step)
        if not self.history or self.history[-1][1] != names:  # host lists, compared on host
            self.history.append((step, names))

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "index": self.index,
            "value": self.value,
            "history": [[step, [list(n) for n in names]] for step, names in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.index, self.value = (
            state[k].to(self.device) for k in ("step", "index", "value")
        )
        self.history = [(step, [tuple(n) for n in names]) for step, names in state["history"]]

    def read(self) -> dict[str, Any] | None:
        """Host copy (a sync): the first call of that step whose value was inf/nan."""
        step = int(self.step)
        if step < 0:
            return None
        names = next(n for s, n in reversed(self.history) if s <= step)
        name, dtype = names[int(self.index)]
        return {"step": step, "module": name, "dtype": dtype, "max_abs": float(self.value)}


class Hooks:
    """Hook handles, removed together by detach()."""

    handles: list[torch.utils.hooks.RemovableHandle]

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class ModuleProbe(Hooks):
    """Hooks on every named module recording `measure` (max |x|) per call, while attached."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        measure: Callable[[torch.Tensor], torch.Tensor] = _max_abs,
        inputs: bool = False,
    ) -> None:
        self.modules = [(name, m) for name, m in model.named_modules() if name]
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.calls: dict[str, list] = {"forward": [], "backward": []}
        self.measure = measure
        self.inputs: list | None = [] if inputs else None  # per forward call, as calls[forward]
        self.first = {phase: FirstNonFinite(device) for phase in self.calls}
        # id(input) -> (input, [its latest reader]); the reference keeps the id from reuse
        self.grad_owner: dict[int, tuple[torch.Tensor, list[str]]] = {}
        self.act_max: torch.Tensor | None = None  # per forward call, max over watched steps
        self.act_names: list[tuple[str, str]] = []

    def attach(self) -> None:
        if not self.handles:
            self.handles = [
                m.register_forward_hook(self._forward_hook(name)) for name, m in self.modules
            ]

    def _forward_hook(self, name: str):
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not module.training:
                return  # evaluation passes are not training steps
            for t in _tensors(output)[:1]:
                self.calls["forward"].append((self.measure(t), name, str(t.dtype)))
                if self.inputs is not None:
                    given = _tensors(args)[:1]
                    self.inputs.append(self.measure(given[0]) if given else None)
            if torch.is_grad_enabled():
                for t in _tensors(args):
                    if not t.requires_grad:
                        continue
                    # a tensor read by several modules (identity layers pass it on): its
                    # gradient is named after the last reader, the first one backward reaches
                    if id(t) in self.grad_owner:
                        self.grad_owner[id(t)][1][0] = name
                    else:
                        owner = [name]
                        self.grad_owner[id(t)] = (t, owner)
                        t.register_hook(self._grad_hook(owner))

        return hook

    def _grad_hook(self, owner: list[str]):
        def hook(grad: torch.Tensor) -> None:
            self.calls["backward"].append((self.measure(grad), owner[0], str(grad.dtype)))

        return hook

    def end_step(self, step: int) -> None:
        """Stack this step's values (device ops only) and update the first-non-finite records."""
        self.grad_owner.clear()
        for phase, calls in self.calls.items():
            if not calls:
                continue
            values = torch.stack([c[0] for c in calls])
            names = [(c[1], c[2].replace("torch.", "")) for c in calls]
            self.first[phase].update(values, names, step)
            if phase == "forward":
                self.act_max, self.act_names = running_max(self.act_max, values), names
            calls.clear()

    def read_activations(self) -> dict[str, tuple[float, str]]:
        """Max |activation| per module over the watched steps since the last read (a sync)."""
        if self.act_max is None:
            return {}
        result: dict[str, tuple[float, str]] = {}
        for value, (name, dtype) in zip(self.act_max.tolist(), self.act_names):
            if name not in result or not value <= result[name][0]:  # nan wins
                result[name] = (value, dtype)
        self.act_max = None
        return result

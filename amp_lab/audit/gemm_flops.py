"""The GEMM FLOPs of a step per module and per dtype, counted op by op from the real inputs.

A TorchDispatchMode sees every aten op of the forward and the backward with the tensors it really
got (after autocast's casts, FSDP's all-gathers, fp8's conversions). Each matmul and convolution
is counted with torch.utils.flop_counter's own formula for that op and filed under the dtype of
its operands and its module (see GemmFlops).
Ops without a formula in torch's registry (CPU's fused attention among them) are not counted.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from amp_lab.precision.modes import dtype_name

OUTSIDE = "(outside the model)"  # ops no module of the model runs (a wrapper's, the loss's)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def operand_dtype(args: tuple[Any, ...], tf32: dict[str, bool], conv: bool) -> str:
    """The dtype a GEMM computes in, from its tensor operands: fp8 when an operand holds float8
    data (torchao's Float8TrainingTensor keeps it in `_data`, its own dtype is the original
    one), tf32 for fp32 operands on CUDA with the backend's TF32 switch on."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if any(getattr(t, "_data", t).dtype in FLOAT8 for t in tensors):
        return "fp8"
    # the first matrix operand: addmm's first argument is the (1-D) bias
    operands = [t for t in tensors if t.dim() >= 2] or tensors
    dtype = operands[0].dtype if operands else torch.float32
    if dtype == torch.float32 and operands and operands[0].is_cuda:
        return "tf32" if tf32["conv" if conv else "matmul"] else "fp32"
    return dtype_name(dtype)


def tf32_switches() -> dict[str, bool]:
    """Whether CUDA's fp32 matmuls and cuDNN's fp32 convolutions may use TF32 right now."""
    return {
        "matmul": torch.backends.cuda.matmul.fp32_precision == "tf32",
        # set at import by torch.backends.cudnn, but absent from its type stubs
        "conv": torch.backends.cudnn.conv.fp32_precision == "tf32",  # type: ignore[attr-defined]
    }


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of the memory a tensor's values live in (torchao's float8 tensors: their
    `_data`); views share it."""
    try:
        return getattr(tensor, "_data", tensor).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without storage
        return None


class GemmFlops(TorchDispatchMode):
    """Counts matmul/convolution FLOPs per (module, dtype) while active; `flops` holds them.

    A forward op belongs to the innermost module running (global forward hooks keep the stack).
    A backward op belongs to the module whose forward made the autograd node running it: each
    forward output is marked with its module (by the memory it lives in), and when it is next
    used its grad_fn is filed under that module.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.names = {m: name for name, m in model.named_modules()}
        self.running: list[str] = []
        self.made_by: dict[int, str] = {}  # storage address -> module whose forward wrote it
        self.node_of: dict[Any, str] = {}  # autograd node -> module whose forward made it
        self.tf32 = tf32_switches()
        self.flops: dict[tuple[str, str], int] = defaultdict(int)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self.running.append(self.names.get(module, OUTSIDE))

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.running.pop()

    @contextlib.contextmanager
    def tracking_modules(self) -> Iterator[None]:
        """Keep the stack of running modules (global forward hooks) while inside; the dispatch
        mode itself is entered only around the passes to count (`with counter:`)."""
        hooks = [
            torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
            torch.nn.modules.module.register_module_forward_hook(self._leave),
        ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.node_of.clear()  # the step's graph is freed with it

    def _module(self, args: Any, out: Any) -> str:
        """The module this op belongs to; in the forward, file its inputs' nodes and outputs."""
        # torch's ModuleTracker tells backward from forward the same way; the running node is
        # what the autograd engine is executing (torch._C: no public accessor for either)
        if torch._C._current_graph_task_id() != -1:  # backward
            return self.node_of.get(torch._C._current_autograd_node(), OUTSIDE)
        module = next((m for m in reversed(self.running) if m != OUTSIDE), OUTSIDE)
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.grad_fn is not None and t.grad_fn not in self.node_of:
                self.node_of[t.grad_fn] = self.made_by.get(_storage(t) or 0, module)
        inputs = {_storage(t) for t in tensors}
        for t in tree_flatten(out)[0]:  # new memory only: a view's is still its base's producer's
            if isinstance(t, torch.Tensor) and (address := _storage(t)) not in inputs:
                self.made_by[address or 0] = module
        return module

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        module = self._module(args, out)
        packet = func._overloadpacket
        formula = flop_registry.get(packet)
        if formula is not None:
            dtype = operand_dtype(args, self.tf32, "conv" in packet.__name__)
            self.flops[(module, dtype)] += int(formula(*args, **kwargs, out_val=out))
        return out

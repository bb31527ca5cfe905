"""`build(settings, out_dir) -> Run`: one run's parts, assembled in named phases.

Each phase is a function of the settings and of what the phases before it made; `build` calls
them in the one order the code allows. Random draws happen in this order too (the seed is set in
placement), so a run is reproducible.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from timm.data import Mixup
from timm.utils import ModelEmaV3
from torch.amp import GradScaler

from amp_lab.audit.audit import PrecisionAudit, expected
from amp_lab.checkpoint.store import Checkpointer
from amp_lab.choices import CompileMode
from amp_lab.components.augment import build_mixup
from amp_lab.components.compile import (
    check_backend,
    compile_model,
    compile_optimizer_step,
    optimizer_to_compile,
)
from amp_lab.components.data import DataSource, EpochBatchSampler, build_data
from amp_lab.components.distributed import DistContext, resolve_device
from amp_lab.components.distributed import setup as setup_distributed
from amp_lab.components.ema import build_ema
from amp_lab.components.fsdp import FsdpPlan, resolve_plan, shard_model
from amp_lab.components.loss import build_loss
from amp_lab.components.lr import build_scheduler, peak_lr, warmup_length
from amp_lab.components.models import build_model, check_input_fits, place
from amp_lab.components.optim import build_optimizer
from amp_lab.components.threads import ThreadPlan, apply_threads
from amp_lab.config import AmpLabConfig, ConfigError
from amp_lab.diagnostics.observer import build_diagnostics
from amp_lab.diagnostics.pitfalls import prepare_model, step_class
from amp_lab.health.monitor import Monitor
from amp_lab.health.rules import History
from amp_lab.precision.fp32_modules import keep_in_fp32
from amp_lab.precision.modes import PrecisionPolicy, resolve_precision
from amp_lab.precision.scaling import allowed_holds, build_scaler, uses_dynamic_scaling
from amp_lab.records import METRICS_FILE
from amp_lab.run import LoopState, Run
from amp_lab.search.trial import pruning_sinks
from amp_lab.step import TrainStep
from amp_lab.tracking.sinks import ConsoleSink, JsonlSink, Sink
from amp_lab.tracking.wandb_sink import build_tracking_sinks

log = logging.getLogger(__name__)


class Placement(NamedTuple):
    settings: AmpLabConfig  # data.num_workers fitted to the CPUs this job has
    out_dir: Path  # rank 0's run directory, on every rank
    threads: ThreadPlan
    dist: DistContext
    device: torch.device
    policy: PrecisionPolicy
    fsdp: FsdpPlan | None


def placement(settings: AmpLabConfig, out_dir: Path) -> Placement:
    """Threads, the process group, the seed, the device, the precision policy, the FSDP plan."""
    t = settings.trainer
    threads = apply_threads(t.threads, settings.data.num_workers)
    if threads.workers != settings.data.num_workers:
        settings = replace(settings, data=replace(settings.data, num_workers=threads.workers))
    dist = setup_distributed(t.strategy, t.device)
    if not dist.is_main:  # rank 0 says what this rank would; a line from here lands in its bar
        logging.getLogger("amp_lab").setLevel(logging.ERROR)
    out_dir = Path(dist.broadcast(str(out_dir)))
    random.seed(t.seed)  # every RNG the run draws from; torch's seeds every CUDA device too
    np.random.seed(t.seed)
    torch.manual_seed(t.seed)
    fsdp = resolve_plan(settings) if dist.shards else None
    device = resolve_device(dist.device(t.device))
    torch.backends.cudnn.benchmark = device.type == "cuda"  # time conv algorithms once
    policy = resolve_precision(settings.precision.name, device, settings.precision)
    return Placement(settings, out_dir, threads, dist, device, policy, fsdp)


class Feed(NamedTuple):
    data: DataSource
    mixup: Mixup | None
    sampler: EpochBatchSampler
    steps_per_epoch: int
    global_batch: int
    total_steps: int


def data(settings: AmpLabConfig, where: Placement) -> Feed:
    """The data set on the device, mixup, this rank's batch order and the run's length."""
    t, dist = settings.trainer, where.dist
    source = build_data(
        settings.data, t.seed, where.device, settings.model.name, settings.model.channels_last
    )
    mixup = build_mixup(settings.data, source.spec.num_classes, t.batch_size)
    sampler = EpochBatchSampler(len(source.train), t.batch_size, t.seed, dist.rank, dist.world_size)
    steps_per_epoch = len(sampler) // t.grad_accum
    global_batch = t.batch_size * t.grad_accum * dist.world_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the global batch (batch_size x grad_accum x ranks) = {global_batch} exceeds the "
            f"{len(source.train)} training samples; lower it"
        )
    total_steps = t.max_steps or t.epochs * steps_per_epoch
    return Feed(source, mixup, sampler, steps_per_epoch, global_batch, total_steps)


def model(settings: AmpLabConfig, where: Placement, feed: Feed) -> torch.nn.Module:
    """The timm model on its device, its fp32 modules, the pitfall lab's faults, FSDP shards."""
    net = place(build_model(settings.model, feed.data.spec), where.device)
    check_input_fits(net, settings.model.name, feed.data.spec, where.device)
    keep_in_fp32(net, settings.precision.fp32_modules, where.device)
    prepare_model(net, settings.fault, settings.pitfall.name, where.policy)
    if where.fsdp is not None:  # DTensor shards replace the parameters: before the optimizer
        shard_model(net, settings.fsdp.wrap, where.fsdp)
    return net


class Optimization(NamedTuple):
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    peak_lr: float
    warmup: int


def optimization(settings: AmpLabConfig, feed: Feed, net: torch.nn.Module) -> Optimization:
    """The optimizer over the model's weights and its LR schedule."""
    peak = peak_lr(settings.lr, feed.global_batch)
    warmup = warmup_length(settings.lr, feed.steps_per_epoch)
    if warmup >= feed.total_steps:
        log.warning(
            "the LR warmup (%d steps) is as long as the run (%d steps): the LR never reaches its "
            "peak; shorten lr.warmup_steps / lr.warmup_epochs",
            warmup,
            feed.total_steps,
        )
    optimizer = build_optimizer(
        net, optimizer_to_compile(settings.optim, settings.trainer.compile), peak
    )
    # the schedule holds the param-group dicts, which precision() keeps (it swaps their params)
    scheduler = build_scheduler(optimizer, settings.lr, feed.total_steps, feed.steps_per_epoch)
    return Optimization(optimizer, scheduler, peak, warmup)


class Precision(NamedTuple):
    before_unscale: Callable[[], None]  # the pure modes copy 16-bit grads into the masters
    scaler: GradScaler
    dynamic: bool  # the scaler adapts the scale (backs off, grows): judged so by the monitor
    holds: int  # skips in a row it may keep its scale through (hysteresis): so judged too


def precision(
    settings: AmpLabConfig, where: Placement, net: torch.nn.Module, opt: Optimization
) -> Precision:
    """fp8 layers, 16-bit weights with fp32 masters in the optimizer's param groups, the scaler."""
    before_unscale = where.policy.prepare(net, opt.optimizer)
    scaler = build_scaler(settings.scaler, where.policy)
    dynamic = uses_dynamic_scaling(settings.scaler, where.policy)
    return Precision(before_unscale, scaler, dynamic, allowed_holds(settings.scaler))


class Stepping(NamedTuple):
    train_step: TrainStep
    ema: ModelEmaV3 | None


def step(
    settings: AmpLabConfig,
    where: Placement,
    net: torch.nn.Module,
    opt: Optimization,
    prec: Precision,
) -> Stepping:
    """The training step over the wrapped (DDP) and compiled model, and the EMA it feeds."""
    t = settings.trainer
    make_step = step_class(settings.pitfall.name, settings.fault)  # the pitfall lab's class
    ema = build_ema(net, t.ema)  # after precision(): a copy of the cast weights
    parallel = where.dist.wrap(net, where.device)
    forward = parallel
    if t.compile != CompileMode.off:
        check_backend(t.compile_backend)
        forward = compile_model(parallel, t.compile_backend)
    # the step builds its numerics observer from its view
    train_step = make_step(
        forward,
        opt.optimizer,
        opt.scheduler,
        prec.scaler,
        where.policy,
        prec.before_unscale,
        t.clip_grad,
        t.clip_mode,
        where.dist.micro_batch_context(parallel),
        observe=functools.partial(
            build_diagnostics,
            settings.diagnostics,
            settings.scaler,
            prec.dynamic,
            t.log_every,
            where.out_dir if where.dist.is_main else None,
        ),
        loss=build_loss(settings.data),
    )
    return Stepping(train_step, ema)


def monitor(settings: AmpLabConfig, where: Placement, feed: Feed, prec: Precision) -> Monitor:
    """The run's per-step counters and its health judge (amp_lab/health/)."""
    history = History(
        prec.dynamic,
        float(prec.scaler.get_scale()),
        math.log(feed.data.spec.num_classes),
        prec.holds,
    )
    return Monitor(settings.health, where.device, settings.trainer.log_every, prec.scaler, history)


class Resume(NamedTuple):
    state: LoopState
    checkpointer: Checkpointer
    finished: dict[str, Any] | None


def resume(
    settings: AmpLabConfig,
    where: Placement,
    net: torch.nn.Module,
    opt: Optimization,
    prec: Precision,
    stepping: Stepping,
    watch: Monitor,
) -> Resume:
    """A directory whose run finished keeps its results (a relaunched sweep trains only what did
    not finish); one holding a checkpoint resumes from it."""
    state = LoopState()
    held = {
        "model": net,
        "optimizer": opt.optimizer,
        "scheduler": opt.scheduler,
        "scaler": prec.scaler,
        "monitor": watch,
        "diagnostics": stepping.train_step.diagnostics,
        **({"ema": stepping.ema} if stepping.ema else {}),
    }
    checkpointer = Checkpointer(settings, where.out_dir, state, held, where.dist, where.device)
    finished = checkpointer.records.finished(settings) if settings.trainer.resume else None
    if finished is None:
        checkpointer.restore()
    if settings.trainer.compile == CompileMode.step:  # after the restore: it puts back the LR
        compile_optimizer_step(opt.optimizer, settings.trainer.compile_backend)
    return Resume(state, checkpointer, finished)


def audit(
    settings: AmpLabConfig,
    where: Placement,
    net: torch.nn.Module,
    prec: Precision,
    stepping: Stepping,
) -> PrecisionAudit:
    """The precision audit of the first step this start of the run takes (amp_lab/audit/)."""
    return PrecisionAudit(
        settings,
        expected(settings, where.policy, net, where.fsdp),
        net,
        stepping.train_step,
        prec.scaler,
        stepping.ema,
        where.out_dir if where.dist.is_main else None,
    )


def sinks(settings: AmpLabConfig, where: Placement, feed: Feed) -> list[Sink]:
    """metrics.jsonl, the console and W&B, on rank 0 (the other ranks record nothing); a
    search trial's pruning sink (amp_lab/search/trial.py)."""
    if not where.dist.is_main:
        return []
    return [
        JsonlSink(where.out_dir / METRICS_FILE),
        ConsoleSink(feed.total_steps, settings.trainer.progress),
        *build_tracking_sinks(settings, where.out_dir),
        *pruning_sinks(),
    ]


def build(settings: AmpLabConfig, out_dir: Path) -> Run:
    """The run of `settings` in `out_dir`, every phase in order (ConfigError when it cannot be)."""
    started_at = time.perf_counter()
    where = placement(settings, out_dir)
    settings = where.settings
    feed = data(settings, where)
    net = model(settings, where, feed)
    opt = optimization(settings, feed, net)
    prec = precision(settings, where, net, opt)
    stepping = step(settings, where, net, opt, prec)
    watch = monitor(settings, where, feed, prec)
    resumed = resume(settings, where, net, opt, prec, stepping, watch)
    return Run(
        **where._asdict(),
        **feed._asdict(),
        model=net,
        **opt._asdict(),
        scaler=prec.scaler,
        **stepping._asdict(),
        monitor=watch,
        **resumed._asdict(),
        audit=audit(settings, where, net, prec, stepping),
        sinks=sinks(settings, where, feed),
        started_at=started_at,
    )

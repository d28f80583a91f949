"""Megatron-Bridge's SchedulerConfig: the learning-rate and weight-decay schedule's fields, checked.

Importable without torch, so a trainer checks its schedule flags before the heavy imports;
megatron_eopt.integrations.megatron_bridge re-exports it and builds megatron-core's scheduler from it.
"""

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Literal, Optional, Union

LrDecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WsdDecayStyle = Literal["exponential", "linear", "cosine", "minus_sqrt"]
WdIncrStyle = Literal["constant", "linear", "cosine"]


@dataclass(kw_only=True)
class SchedulerConfig:
    """Learning-rate and weight-decay schedule (Megatron-Bridge's field names and defaults).

    Training length is given in iterations (`train_iters`, with the `*_iters` fields) or in
    samples (`train_samples`, with the `*_samples` fields), never both. Iterations are turned
    into samples with `global_batch_size`, because megatron-core's scheduler counts samples.
    `start_weight_decay`/`end_weight_decay` default (None) to the optimizer's `weight_decay`.
    """

    lr_decay_style: str = "linear"
    lr_wsd_decay_style: str = "exponential"
    lr_decay_iters: Optional[int] = None  # None: train_iters
    lr_decay_samples: Optional[int] = None  # None: train_samples
    lr_wsd_decay_iters: Optional[int] = None
    lr_wsd_decay_samples: Optional[int] = None
    lr_warmup_fraction: Optional[float] = None  # of the decay steps; excludes lr_warmup_iters/samples
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    # From Bridge's TrainingConfig: what turns iterations into samples.
    global_batch_size: int = 1
    train_iters: Optional[int] = None
    train_samples: Optional[int] = None

    def __post_init__(self) -> None:
        self.finalize()

    def finalize(self) -> "SchedulerConfig":
        """Validate every field; call again after mutating fields. Returns self."""
        _check_scheduler_types(self)
        _check_scheduler_values(self)
        return self

    @property
    def is_sample_based(self) -> bool:
        return self.train_samples is not None

    @property
    def lr_decay_steps(self) -> int:
        if self.is_sample_based:
            return self.lr_decay_samples if self.lr_decay_samples is not None else self.train_samples
        iters = self.lr_decay_iters if self.lr_decay_iters is not None else self.train_iters
        return iters * self.global_batch_size

    @property
    def lr_warmup_steps(self) -> Union[int, float]:
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.lr_decay_steps  # a float, as in Bridge
        if self.is_sample_based:
            return self.lr_warmup_samples
        return self.lr_warmup_iters * self.global_batch_size

    @property
    def wd_incr_steps(self) -> int:
        return self.train_samples if self.is_sample_based else self.train_iters * self.global_batch_size

    @property
    def wsd_decay_steps(self) -> Optional[int]:
        if self.is_sample_based:
            return self.lr_wsd_decay_samples
        if self.lr_wsd_decay_iters is None:
            return None
        return self.lr_wsd_decay_iters * self.global_batch_size


def _scheduler_error(name: str, message: str) -> ValueError:
    return ValueError(f"SchedulerConfig.{name} {message}")


def _check_scheduler_types(config: SchedulerConfig) -> None:
    hints = typing.get_type_hints(SchedulerConfig)
    for field in dataclasses.fields(SchedulerConfig):
        expected = hints[field.name]
        value = getattr(config, field.name)
        if typing.get_origin(expected) is typing.Union:
            if value is None:
                continue
            expected = next(t for t in typing.get_args(expected) if t is not type(None))
        if expected not in (bool, int, float, str):
            continue
        ok = isinstance(value, (int, float) if expected is float else expected)
        if not ok or (expected is not bool and isinstance(value, bool)):
            raise TypeError(
                f"SchedulerConfig.{field.name} must be {expected.__name__}; got "
                f"{type(value).__name__} {value!r}."
            )


def _check_choice(config: SchedulerConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise _scheduler_error(name, f"must be one of {', '.join(map(repr, choices))}; got {value!r}.")


def _check_scheduler_values(config: SchedulerConfig) -> None:
    _check_choice(config, "lr_decay_style", typing.get_args(LrDecayStyle))
    _check_choice(config, "lr_wsd_decay_style", typing.get_args(WsdDecayStyle))
    _check_choice(config, "weight_decay_incr_style", typing.get_args(WdIncrStyle))
    _check_counts(config)
    _check_training_length(config)
    _check_warmup(config)
    _check_wsd(config)
    _check_weight_decay(config)
    if config.override_opt_param_scheduler and config.use_checkpoint_opt_param_scheduler:
        raise _scheduler_error(
            "override_opt_param_scheduler",
            "and use_checkpoint_opt_param_scheduler are both True; choose at most one.",
        )


def _check_counts(config: SchedulerConfig) -> None:
    if config.global_batch_size < 1:
        raise _scheduler_error("global_batch_size", f"must be >= 1; got {config.global_batch_size}.")
    for name in ("lr_warmup_iters", "lr_warmup_samples"):
        if getattr(config, name) < 0:
            raise _scheduler_error(name, f"must be >= 0; got {getattr(config, name)}.")
    for name in ("train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples",
                 "lr_wsd_decay_iters", "lr_wsd_decay_samples"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise _scheduler_error(name, f"must be >= 1 or None; got {value}.")
    if not (math.isfinite(config.lr_warmup_init) and config.lr_warmup_init >= 0.0):
        raise _scheduler_error("lr_warmup_init", f"must be a finite number >= 0; got {config.lr_warmup_init}.")


def _check_training_length(config: SchedulerConfig) -> None:
    if (config.train_iters is None) == (config.train_samples is None):
        raise _scheduler_error(
            "train_iters",
            f"or train_samples must be set, not both (the scheduler's step counts derive from "
            f"it); got train_iters={config.train_iters}, train_samples={config.train_samples}.",
        )
    # Fields of the other unit than the run's are mistakes (Bridge rejects them too).
    wrong_unit = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters") if config.is_sample_based else (
        "lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")
    unit = "train_samples" if config.is_sample_based else "train_iters"
    for name in wrong_unit:
        if getattr(config, name) not in (None, 0):
            raise _scheduler_error(
                name,
                f"is set ({getattr(config, name)}) but the run is measured by {unit}; use the "
                f"*_{'samples' if config.is_sample_based else 'iters'} fields only.",
            )


def _check_warmup(config: SchedulerConfig) -> None:
    if config.lr_warmup_fraction is not None:
        if not 0.0 <= config.lr_warmup_fraction < 1.0:
            raise _scheduler_error("lr_warmup_fraction", f"must be in [0, 1); got {config.lr_warmup_fraction}.")
        if config.lr_warmup_iters or config.lr_warmup_samples:
            raise _scheduler_error(
                "lr_warmup_fraction",
                f"excludes lr_warmup_iters/lr_warmup_samples; got lr_warmup_iters="
                f"{config.lr_warmup_iters}, lr_warmup_samples={config.lr_warmup_samples}.",
            )
    if config.lr_warmup_steps >= config.lr_decay_steps:
        name = "lr_warmup_fraction" if config.lr_warmup_fraction is not None else (
            "lr_warmup_samples" if config.is_sample_based else "lr_warmup_iters")
        raise _scheduler_error(
            name,
            f"gives {config.lr_warmup_steps} warmup samples, not fewer than the "
            f"{config.lr_decay_steps} decay samples; shorten the warmup or lengthen the decay.",
        )


def _check_wsd(config: SchedulerConfig) -> None:
    name = "lr_wsd_decay_samples" if config.is_sample_based else "lr_wsd_decay_iters"
    wsd_steps = config.wsd_decay_steps
    if config.lr_decay_style == "WSD" and wsd_steps is None:
        raise _scheduler_error(name, "must be set when lr_decay_style='WSD' (the length of its decay phase).")
    if wsd_steps is not None and wsd_steps > config.lr_decay_steps:
        raise _scheduler_error(
            name, f"gives {wsd_steps} samples, more than the {config.lr_decay_steps} decay samples."
        )


def _check_weight_decay(config: SchedulerConfig) -> None:
    for name in ("start_weight_decay", "end_weight_decay"):
        value = getattr(config, name)
        if value is not None and not (math.isfinite(value) and value >= 0.0):
            raise _scheduler_error(name, f"must be a finite number >= 0 or None; got {value}.")
    start, end = config.start_weight_decay, config.end_weight_decay
    if start is not None and end is not None:
        check_weight_decay_pair(start, end, config.weight_decay_incr_style)


def check_weight_decay_pair(start: float, end: float, style: str) -> None:
    if end < start:
        raise _scheduler_error("end_weight_decay", f"({end}) must not be below SchedulerConfig.start_weight_decay ({start}).")
    if style == "constant" and start != end:
        raise _scheduler_error(
            "weight_decay_incr_style",
            f"is 'constant' but start_weight_decay ({start}) != end_weight_decay ({end}); use "
            f"'linear' or 'cosine', or make them equal.",
        )

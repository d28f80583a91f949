"""How the fp32 main weights of 16-bit parameters are held between steps (docs/memory.md).

- `Fp32Copies` (the default): a persistent fp32 copy per parameter, 4 bytes per parameter.
- `Remainders` (`store_param_remainders` with bf16 parameters, megatron-core's meaning): the fp32
  main weight is the bf16 parameter plus a signed 16-bit remainder, 2 bytes per parameter. The
  high 16 bits are the fp32 bits rounded half away from zero (add 0x8000, keep the top half), the
  remainder is what is left: main_bits = (param_bits << 16) + remainder (mod 2^32), exact for
  every fp32 value. The parameter equals round-to-nearest-even of the main weight except at exact
  ties (low half 0x8000) where the even neighbour is below: there it is one unit in the last place
  above, since a remainder of +0x8000 does not fit in 16 signed bits.
- `ModelDtype` (`main_params_dtype` = the model's 16-bit dtype, remainders off): no copy; the
  parameter is the main weight, updated in fp32 and rounded to nearest (even) after each step.

Between steps the main parameters that the inner torch optimizer steps hold no memory (`release`:
an expanded one-element tensor); `materialize` gives them their fp32 values before the step.
"""

from typing import Optional

import torch

_TOP_HALF, _HALF = 0xFFFF, 0x8000


def split_fp32(main: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `main` -> (bf16 high half rounded half away from zero, int16 remainder)."""
    bits = main.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifted = bits + _HALF
    high = (shifted >> 16) & _TOP_HALF
    remainder = (shifted & _TOP_HALF) - _HALF
    high = torch.where(high > 0x7FFF, high - 0x10000, high).to(torch.int16)
    return high.view(torch.bfloat16), remainder.to(torch.int16)


def join_fp32(high: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 value that `split_fp32` split into (`high`, `remainder`), bit for bit."""
    top = high.detach().contiguous().view(torch.int16).to(torch.int64) & _TOP_HALF
    bits = ((top << 16) + remainder.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(bits > 0x7FFFFFFF, bits - 0x100000000, bits).to(torch.int32).view(torch.float32)


def release(main: torch.nn.Parameter) -> None:
    """Drop `main`'s values, keeping its shape (so a gradient can still be attached)."""
    main.data = torch.empty((), dtype=torch.float32, device=main.device).expand(main.shape)


class Fp32Copies:
    """Persistent fp32 main copies (the default)."""

    holds_fp32 = True

    def set(self, model: torch.nn.Parameter, main: torch.nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            main.copy_(value)  # the model parameter comes from the model's own checkpoint

    def value(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> torch.Tensor:
        return main.detach()

    def materialize(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        pass

    def store(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        with torch.no_grad():
            model.copy_(main)

    def nbytes(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> int:
        return main.numel() * main.element_size()


class Remainders:
    """bf16 parameter + int16 remainder = the exact fp32 main weight (module docstring)."""

    holds_fp32 = False

    def __init__(self) -> None:
        self.remainder_of: dict[int, torch.Tensor] = {}  # id(model) -> int16 remainder

    def set(self, model: torch.nn.Parameter, main: torch.nn.Parameter, value: torch.Tensor) -> None:
        if model.dtype != torch.bfloat16:
            raise TypeError(f"store_param_remainders needs bf16 parameters; got {model.dtype}.")
        high, remainder = split_fp32(value.float())
        with torch.no_grad():
            model.data.view(torch.int16).copy_(high.view(torch.int16))
        self.remainder_of[id(model)] = remainder
        release(main)

    def value(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> torch.Tensor:
        return join_fp32(model, self.remainder_of[id(model)])

    def materialize(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        main.data = self.value(model, main)

    def store(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        self.set(model, main, main.detach())

    def nbytes(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> int:
        remainder = self.remainder_of[id(model)]
        return remainder.numel() * remainder.element_size()


class ModelDtype:
    """The 16-bit parameter is the main weight; fp32 only during the update."""

    holds_fp32 = False

    def set(self, model: torch.nn.Parameter, main: torch.nn.Parameter, value: torch.Tensor) -> None:
        with torch.no_grad():
            model.copy_(value)  # rounded to nearest, ties to even
        release(main)

    def value(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> torch.Tensor:
        return model.detach().float()

    def materialize(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        main.data = self.value(model, main)

    def store(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        self.set(model, main, main.detach())

    def nbytes(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> int:
        return 0


def main_param_storage_for(config) -> Optional[object]:
    """The storage `config` asks for (precision-aware fields), for 16-bit models; None for fp32 copies."""
    if not config.use_precision_aware_optimizer:
        return None
    if config.bf16 and config.store_param_remainders:
        return Remainders()
    if config.main_params_dtype != torch.float32:
        return ModelDtype()  # config/precision.py allows only the model's own 16-bit dtype
    return None


class OnHost:
    """`inner`'s main weights, those of the parameters in `offloaded` (ids of model parameters)
    held on the host between steps (offload/host_resident.py): the fp32 copy for `Fp32Copies`,
    the remainder for `Remainders`; `ModelDtype` holds nothing beyond the model's parameter.
    Their main parameters hold no memory between steps; `materialize` copies them in."""

    def __init__(self, inner, offloaded: set[int], pin: bool) -> None:
        self.inner = inner
        self.holds_fp32 = inner.holds_fp32
        self._offloaded = offloaded
        self._pin = pin and torch.cuda.is_available()
        self.host_of: dict[int, torch.Tensor] = {}  # id(model) -> fp32 main weight or remainder, on the host

    def _host(self, key: int, value: torch.Tensor) -> None:
        kept = self.host_of.get(key)
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
            kept = self.host_of[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=self._pin)
        kept.copy_(value)

    def set(self, model: torch.nn.Parameter, main: torch.nn.Parameter, value: torch.Tensor) -> None:
        if id(model) in self._offloaded and isinstance(self.inner, Fp32Copies):
            self._host(id(model), value)
            release(main)
            return
        self.inner.set(model, main, value)
        if id(model) in self._offloaded and isinstance(self.inner, Remainders):
            self._host(id(model), self.inner.remainder_of.pop(id(model)))

    def value(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> torch.Tensor:
        if id(model) not in self.host_of:
            return self.inner.value(model, main)
        if isinstance(self.inner, Fp32Copies):
            return self.host_of[id(model)]
        return join_fp32(model, self.host_of[id(model)].to(model.device))

    def materialize(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        if id(model) not in self.host_of:
            self.inner.materialize(model, main)
            return
        host = self.host_of[id(model)]
        device = torch.empty(host.shape, dtype=host.dtype, device=model.device)
        device.copy_(host, non_blocking=self._pin)
        main.data = device if isinstance(self.inner, Fp32Copies) else join_fp32(model, device)

    def store(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> None:
        if id(model) in self._offloaded and isinstance(self.inner, Fp32Copies):
            with torch.no_grad():
                model.copy_(main)
        if id(model) in self._offloaded:
            self.set(model, main, main.detach())  # the updated main weight back to the host
        else:
            self.inner.store(model, main)

    def nbytes(self, model: torch.nn.Parameter, main: torch.nn.Parameter) -> int:
        """Device bytes: none for an offloaded parameter."""
        return 0 if id(model) in self.host_of else self.inner.nbytes(model, main)

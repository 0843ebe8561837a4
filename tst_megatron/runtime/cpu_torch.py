"""What megatron-core's modules see as ``torch`` on a CPU (:mod:`tst_megatron.runtime.cpu`
puts it in their namespaces): a module that forwards every attribute to torch, except that
tensor factories map a CUDA device to the CPU and ``torch.cuda`` is :class:`_CpuCuda`
(streams and events that keep ordering trivially, the CPU generator as the "CUDA" RNG, no
GPU), with a ``torch.utils.data.DataLoader`` that seeds each loader's own generator. Nothing
in ``torch`` itself is changed."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "linspace",
        "rand",
        "randn",
        "randint",
        "randperm",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "eye",
        "empty_strided",
    }
)

_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    """Map ``'cuda'``, ``'cuda:N'``, ``torch.device('cuda')`` or a device index to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__doc__ = fn.__doc__
    return factory


class _Event:
    """A CUDA event on a synchronous device: already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        return None

    def synchronize(self):
        return None

    def wait(self, stream=None):
        return None

    def query(self):
        return True


class _Stream(torch.Stream):
    """A CUDA stream on a synchronous device: work is already ordered. A ``torch.Stream`` (of
    the CPU), so that ``tensor.record_stream(stream)`` accepts it (:func:`enable` gives
    ``aten::record_stream`` a CPU kernel that does nothing)."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device="cpu")

    def __init__(self, *args, **kwargs):
        pass

    @staticmethod
    def priority_range():
        return (0, 0)

    def wait_stream(self, stream):
        return None

    def wait_event(self, event):
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        return None

    def query(self):
        return True


_DEFAULT_STREAM = _Stream()


#: What the stand-in answers for the device by default: no CUDA architecture.
_NO_GPU = types.SimpleNamespace(
    name="cpu", major=0, minor=0, total_memory=0, multi_processor_count=0
)


class _CpuCuda(types.ModuleType):
    """What megatron-core sees as ``torch.cuda`` under :func:`enable` (and a dry run's
    validation, with ``gpu`` the assumed cluster GPU: :mod:`tst_megatron.training.assumed`)."""

    Stream = _Stream
    Event = _Event

    def __init__(self, *, one_device: bool = False, gpu=_NO_GPU):
        super().__init__("torch.cuda (tst_megatron CPU stand-in)")
        self._one_device = one_device
        self._gpu = gpu

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return _CPU

    def device_count(self):
        """0, or 1 for ``megatron.training.initialize`` (see the module docstring, point 5)."""
        return 1 if self._one_device else 0

    def is_available(self):
        """torch's answer, or True for ``megatron.training.initialize`` (point 5)."""
        return True if self._one_device else torch.cuda.is_available()

    def get_device_capability(self, device=None):
        """``gpu``'s compute capability, (0, 0) by default (``validate_args`` compares it)."""
        return (self._gpu.major, self._gpu.minor)

    def get_device_properties(self, device=None):
        """``gpu``: by default ``major``/``minor`` 0 and no CUDA memory."""
        return self._gpu

    @staticmethod
    def memory_stats(device=None):
        return {}

    @staticmethod
    def current_stream(device=None):
        return _DEFAULT_STREAM

    default_stream = current_stream

    @staticmethod
    def stream(stream=None):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device=None):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def set_device(device):
        return None

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    @staticmethod
    def manual_seed(seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    @staticmethod
    def memory_allocated(device=None):
        return 0

    max_memory_allocated = memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = memory_allocated


class _OwnSeedDataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` whose iterators draw their workers' base seed from a
    generator of its own instead of torch's global one (point 6 of the module docstring).

    ``iter(loader)`` draws one number from ``loader.generator``, torch's global CPU generator
    when none is given. On a CPU that is also the generator dropout draws from, and
    Megatron-LM builds its data iterators after a resume has restored the RNG states, so a
    resumed run would draw its dropout masks one number off the uninterrupted run's.
    Megatron-LM's ``build_pretraining_data_loader`` passes no generator.
    """

    def __init__(self, *args, generator=None, **kwargs):
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(0)  # only the workers' seeds: Megatron's datasets draw none
        super().__init__(*args, generator=generator, **kwargs)


def _forwarding_module(name: str, real: types.ModuleType, **own) -> types.ModuleType:
    """A module object answering ``own``'s attributes itself and every other from ``real``."""

    class Forward(types.ModuleType):
        def __getattr__(self, attr):
            return getattr(real, attr)

    module = Forward(name)
    for attr, value in own.items():
        setattr(module, attr, value)
    return module


#: ``torch.utils`` as the CPU stand-in shows it: ``data.DataLoader`` is :class:`_OwnSeedDataLoader`.
_CPU_UTILS = _forwarding_module(
    "torch.utils (tst_megatron CPU stand-in)",
    torch.utils,
    data=_forwarding_module(
        "torch.utils.data (tst_megatron CPU stand-in)",
        torch.utils.data,
        DataLoader=_OwnSeedDataLoader,
    ),
)


class _CpuTorch(types.ModuleType):
    """What megatron-core sees as ``torch`` under :func:`enable`: torch, CUDA mapped to CPU."""

    def __init__(self, *, one_device: bool = False, gpu=_NO_GPU):
        super().__init__("torch (tst_megatron CPU stand-in)")
        self.cuda = _CpuCuda(one_device=one_device, gpu=gpu)
        self.utils = _CPU_UTILS
        self.__tst_cpu_stand_in__ = True

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            value = _cpu_factory(value)
            setattr(self, name, value)  # cache
        return value


_CPU_TORCH = _CpuTorch()
#: ``megatron.training.initialize``'s stand-in: CUDA "available" with one device (point 5).
_CPU_TORCH_INIT = _CpuTorch(one_device=True)

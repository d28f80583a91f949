"""megatron_eopt.runtime.megatron_lm_cpu: Megatron-LM's CUDA-only calls replaced while installed, and
only without CUDA, for megatron-core 0.19.x only. Megatron-LM's loop on CPU with it (against
megatron-core's optimizer, exact resume) is tests/functional/test_megatron_lm_loop.py.
"""

import pytest
import torch

from megatron_eopt.runtime import megatron_lm_cpu


@pytest.mark.parametrize("version", ["0.18.2", "0.20.0", "1.19.0", "0.1.9"])
def test_other_megatron_core_versions_are_refused_in_one_line(version: str) -> None:
    with pytest.raises(ValueError) as refused:
        megatron_lm_cpu.check_megatron_core_version(version)
    message = str(refused.value)
    assert "\n" not in message and version in message and "0.19.x" in message, message


@pytest.mark.parametrize("version", ["0.19.0", "0.19.2", "0.19.2+551afdd", "0.19.3rc1"])
def test_megatron_core_0_19_is_accepted(version: str) -> None:
    assert megatron_lm_cpu.check_megatron_core_version(version) == version


def test_inactive_when_cuda_is_available(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device_count = torch.cuda.device_count
    assert megatron_lm_cpu.install() is False and not megatron_lm_cpu.is_installed()
    assert torch.cuda.device_count is device_count
    assert torch.zeros(1, device="cpu").type() == "torch.FloatTensor"


def test_cuda_is_the_cpu_while_installed_and_restored_after() -> None:
    import megatron.core.tensor_parallel.random as tp_random
    import megatron.training.training as training

    before = (torch.cuda.device_count, torch.cuda.get_rng_state, tp_random._set_cuda_rng_state,
              training.initialize_megatron)
    torch.manual_seed(0)
    with megatron_lm_cpu.installed() as active:
        assert active and megatron_lm_cpu.install() is True  # idempotent
        assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        for tensor in (torch.zeros(2, device="cuda"), torch.ones(2, device=0), torch.ones(2).cuda(),
                       torch.ones(2).to("cuda:0"), torch.empty(2, pin_memory=True).pin_memory()):
            assert tensor.device == torch.device("cpu")
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"  # names as megatron-core checks them
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_event(torch.cuda.Event())
        # The "CUDA" generator is a CPU generator apart from torch's default one.
        cpu_state = torch.get_rng_state()
        torch.cuda.manual_seed(1234)
        cuda_state = torch.cuda.get_rng_state()
        tp_random._set_cuda_rng_state(cuda_state)
        assert torch.equal(torch.get_rng_state(), cpu_state) and not torch.equal(cuda_state, cpu_state)
        # Dropout draws from it, as on GPUs: the CPU generator stays where it was.
        masks = [torch.nn.functional.dropout(torch.ones(64), 0.5) for _ in range(2)]
        assert torch.equal(torch.get_rng_state(), cpu_state) and not torch.equal(*masks)
        torch.cuda.set_rng_state(cuda_state)
        assert torch.equal(torch.nn.functional.dropout(torch.ones(64), 0.5), masks[0])
        assert training.initialize_megatron.keywords == {"allow_no_cuda": True}
    assert not megatron_lm_cpu.is_installed()
    assert (torch.cuda.device_count, torch.cuda.get_rng_state, tp_random._set_cuda_rng_state,
            training.initialize_megatron) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"

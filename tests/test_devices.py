"""How the GPU a user names becomes torch's index, as torch itself reads the name."""

import pytest

from gpuexp.devices import device_indices


def test_indices_names_and_torch_devices_give_torch_indices():
    torch = pytest.importorskip("torch")
    assert device_indices(1) == [1]
    assert device_indices("cuda:2") == [2]
    assert device_indices(["cuda:0", torch.device("cuda", 3)]) == [0, 3]
    assert device_indices(None) is None


def test_a_bare_cuda_is_torchs_current_device_without_initialising_cuda():
    torch = pytest.importorskip("torch")
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    initialised = torch.cuda.is_initialized()
    assert device_indices("cuda") == [current]
    assert device_indices(torch.device("cuda")) == [current]
    assert torch.cuda.is_initialized() == initialised, "naming a device must not initialise CUDA"


@pytest.mark.parametrize("bad", ["cuda:x", "nvidia", -1, True, "cpu"])
def test_what_names_no_gpu_is_refused_with_the_keyword_and_examples(bad):
    with pytest.raises(ValueError, match=r"device=.*use GPU indices as torch numbers them, e\.g\. device=0"):
        device_indices(bad, argument="device")

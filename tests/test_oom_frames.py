"""Where an out-of-memory error was raised, read from its traceback (python/gpuexp/oom_frames.py):
the failing module's path, and how many layers one pass runs through the numbered containers on
it, which the rescue needs to tell a single forward's repeated layers from a loop's iterations."""

import torch

from gpuexp.oom_frames import failed_frames


class Fails(torch.nn.Module):
    def __init__(self, fails):
        super().__init__()
        self.fails = fails

    def forward(self, x):
        if self.fails:
            raise RuntimeError("refused")
        return x


def raised_in(model):
    try:
        model(torch.ones(1))
    except RuntimeError as error:
        return failed_frames(error)
    raise AssertionError("the model did not raise")


def test_a_failure_in_the_21st_of_24_blocks_runs_through_every_layer_of_its_containers():
    blocks = [torch.nn.Sequential(torch.nn.Identity(), Fails(i == 20)) for i in range(24)]
    frames, path, layers = raised_in(torch.nn.Sequential(*blocks))
    assert path == "Sequential.20.1 (Fails)", path
    assert layers == 24 * 2, "24 blocks of 2 layers each"
    assert frames[0][2] == "forward"


def test_named_children_are_no_numbered_container():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = Fails(True)

        def forward(self, x):
            return self.encoder(x)

    _, path, layers = raised_in(Model())
    assert (path, layers) == ("Model.encoder (Fails)", None)


def test_a_failure_outside_any_module_names_none():
    try:
        raise RuntimeError("refused")
    except RuntimeError as error:
        frames, path, layers = failed_frames(error)
    assert (path, layers) == (None, None) and frames

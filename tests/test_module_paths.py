"""The module-path hooks (python/gpuexp/module_paths.py) on the CPU: which mark each module's
forward and backward leave in torch's per-thread memory metadata. Torch's own
`_set_memory_metadata` needs CUDA, so here it is recorded; on the GPU the marks land in the
allocation history (tests/test_gpu_trace.py)."""

import pytest

torch = pytest.importorskip("torch")

from gpuexp import module_paths  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())

    def forward(self, x):
        return self.mlp(self.attn(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture
def marks(monkeypatch):
    """The marks set, in order, with the thread that set them; the hooks removed afterwards."""
    recorded = []
    memory = torch.cuda.memory
    monkeypatch.setattr(memory, "_set_memory_metadata", lambda mark: recorded.append(mark), raising=False)
    monkeypatch.setattr(memory, "_get_memory_metadata", lambda: "", raising=False)
    monkeypatch.setattr(memory, "_memory_metadata_supported", lambda: True, raising=False)
    yield recorded
    module_paths.uninstall()


def test_each_module_is_marked_by_its_path_in_forward_and_backward(marks, monkeypatch):
    import __main__

    model = Net()
    monkeypatch.setattr(__main__, "model", model, raising=False)
    assert module_paths.install() is None
    model(torch.randn(4, 8)).sum().backward()
    forward = [m for m in marks if m.startswith("forward")]
    assert forward[:3] == ["forward 1: model", "forward 1: model.layers.0", "forward 1: model.layers.0.attn"]
    assert "forward 1: model.layers.1.mlp.0" in forward and marks[len(forward)] == ""
    backward = [m.removeprefix("backward 1: ") for m in marks[len(forward) + 1:]]
    # Blocks only (modules with submodules), innermost first where they share an output node, in
    # reverse order of the forward; a layer's backward goes to its block.
    firsts = list(dict.fromkeys(backward))
    assert firsts == ["model", "model.layers.1.mlp", "model.layers.1", "model.layers.0.mlp", "model.layers.0"]
    count = len(marks)
    module_paths.uninstall()
    assert marks[-1] == "" and not torch.nn.modules.module._global_forward_hooks
    model(torch.randn(4, 8))
    assert len(marks) == count + 1


def test_a_second_pass_numbers_its_marks_and_a_model_not_in_the_namespace_goes_by_its_class(marks):
    assert module_paths.install() is None
    net = Net()
    with torch.no_grad():
        net(torch.randn(2, 8))
        net(torch.randn(2, 8))
    assert "forward 2: Net.layers.1.attn" in marks
    assert not any(m.startswith("backward") for m in marks)


def test_the_users_own_metadata_is_never_overwritten(marks, monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "_get_memory_metadata", lambda: "mine", raising=False)
    assert "own memory metadata" in module_paths.install()
    Net()(torch.randn(2, 8))
    assert marks == []


@pytest.mark.filterwarnings("ignore:Using `torch.compile(module)` when there are global hooks")
def test_compiled_code_skips_the_hooks_even_with_fullgraph(marks):
    assert module_paths.install() is None
    compiled = torch.compile(Net(), backend="eager", fullgraph=True)
    assert compiled(torch.randn(2, 8)).shape == (2, 2)
    # Only the wrapper's own call, outside the graph, is marked; nothing inside the graph.
    assert marks and not any("attn" in mark or "head" in mark for mark in marks)

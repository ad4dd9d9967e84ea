"""The module-path hooks (python/gpuexp/module_paths.py) on the CPU: which mark each module's
forward and backward leave in torch's per-thread memory metadata. Torch's own
`_set_memory_metadata` needs CUDA, so here it is recorded; on the GPU the marks land in the
allocation history (tests/test_gpu_trace.py)."""

import pytest

torch = pytest.importorskip("torch")

from gpuexp import module_paths  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.mlp = MLP()
        self.norm = torch.nn.Sequential(torch.nn.LayerNorm(8))  # a plain Sequential: no block

    def forward(self, x):
        return self.norm(self.mlp(self.attn(x)))


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
    monkeypatch.setattr(module_paths, "_pass", [0])  # passes count from 1 in each test
    yield recorded
    module_paths.uninstall()


def test_each_module_is_marked_by_its_path_in_forward_and_backward(marks, monkeypatch):
    import __main__

    model = Net()
    monkeypatch.setattr(__main__, "model", model, raising=False)
    assert module_paths.install() is None
    model(torch.randn(4, 8)).sum().backward()
    forward = [m for m in marks if m.startswith("forward")]
    # Blocks only: a layer (the Linear called attn, the head) counts to its block.
    assert forward[:3] == ["forward 1: model", "forward 1: model.layers.0", "forward 1: model.layers.0.mlp"]
    assert "forward 1: model.layers.1.mlp" in forward and marks[len(forward)] == ""
    assert not any(word in mark for mark in forward for word in ("attn", "head", "mlp.fc", "norm"))
    backward = [m.removeprefix("backward 1: ") for m in marks[len(forward) + 1:]]
    # The model's layers only (the model, the elements of its ModuleList), in reverse order of the
    # forward: the mlp inside a layer counts to the layer in backward.
    firsts = list(dict.fromkeys(backward))
    assert firsts == ["model", "model.layers.1", "model.layers.0"]
    count = len(marks)
    module_paths.uninstall()
    assert marks[-1] == "" and not torch.nn.modules.module._global_forward_pre_hooks
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    model(torch.randn(4, 8))
    assert len(marks) == count + 1


def test_a_model_and_its_last_layer_share_an_output_node_and_the_layer_is_marked(marks, monkeypatch):
    import __main__

    model = torch.nn.Sequential(MLP(), MLP())
    monkeypatch.setattr(__main__, "model", model, raising=False)
    assert module_paths.install() is None
    model(torch.randn(4, 8)).sum().backward()
    backward = [m for m in marks if m.startswith("backward")]
    # The gradient reaches the model's output and its last layer's at once: the layer is inner, so
    # its mark shows; the model's stays below it (the input needs no gradient: nothing leaves).
    assert list(dict.fromkeys(backward)) == ["backward 1: model.1", "backward 1: model.0"]


def test_a_second_pass_numbers_its_marks_and_a_model_not_in_the_namespace_goes_by_its_class(marks):
    assert module_paths.install() is None
    net = Net()
    with torch.no_grad():
        net(torch.randn(2, 8))
        net(torch.randn(2, 8))
    assert "forward 2: Net.layers.1.mlp" in marks
    assert not any(m.startswith("backward") for m in marks)


def test_a_layer_called_on_its_own_is_no_model_and_the_search_goes_on(marks):
    assert module_paths.install() is None
    loss = torch.nn.Linear(8, 8)
    loss(torch.randn(2, 8))
    assert marks == [] and torch.nn.modules.module._global_forward_pre_hooks, "still looking"
    Net()(torch.randn(2, 8))
    assert marks[0] == "forward 1: Net" and not torch.nn.modules.module._global_forward_pre_hooks
    # A model made later is found once the search is armed again (each cell arms it).
    module_paths.arm()
    later = Net()
    later(torch.randn(2, 8))
    assert "forward 2: Net.layers.0" in marks


def test_a_hook_that_fails_stops_marking_and_never_breaks_the_model(marks, monkeypatch):
    failing = [True]

    def setter(mark):
        if failing[0]:
            raise RuntimeError("no allocator here")
        marks.append(mark)

    monkeypatch.setattr(torch.cuda.memory, "_set_memory_metadata", setter, raising=False)
    assert module_paths.install() is None
    model = Net()
    out = model(torch.randn(4, 8))
    out.sum().backward()
    assert out.shape == (4, 2) and model.head.weight.grad is not None
    failing[0] = False
    assert module_paths.uninstall() == "module paths stopped: RuntimeError: no allocator here"


def test_the_users_own_metadata_is_never_overwritten(marks, monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "_get_memory_metadata", lambda: "mine", raising=False)
    assert "own memory metadata" in module_paths.install()
    Net()(torch.randn(2, 8))
    assert marks == []


@pytest.mark.filterwarnings(r"ignore:Using `torch\.compile\(module\)` when there are global hooks")
def test_compiled_code_skips_the_hooks_even_with_fullgraph(marks):
    assert module_paths.install() is None
    compiled = torch.compile(Net(), backend="eager", fullgraph=True)
    assert compiled(torch.randn(2, 8)).shape == (2, 2)
    # Only the wrapper's own call, outside the graph, is marked; nothing inside the graph.
    assert marks and not any("attn" in mark or "head" in mark for mark in marks)

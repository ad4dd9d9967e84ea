"""The three training steps the trace's cost is gated on besides the bench's own models
(issue 29): a CPU-bound convnet, a launch-bound MLP and a GPU-bound transformer.

- `resnet50`: torchvision's resnet50 at bs 32 (224 × 224, 1000 classes) with SGD;
- `mlp12`: 12 residual blocks (LayerNorm, Linear 1024→2048, GELU, Linear 2048→1024) at bs 64
  with AdamW: a few hundred small kernels, each launched from Python;
- `gpt2`: HF transformers' GPT2LMHeadModel from GPT2Config(n_layer=6, n_embd=768) at bs 8 × 512
  with AdamW.

Each `make_*` returns (step, batch size, what the model needs installed); a step ends
synchronised, as bench/batch_size.py's does.
"""

WORKLOADS = ("resnet50", "mlp12", "gpt2")


def _stepper(torch, model, optimizer, batch, loss_of):
    def step(_batch_size=None):
        inputs, targets = batch
        loss = loss_of(model, inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()

    return step


def make_resnet50(torch, device):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = (torch.randn(32, 3, 224, 224, device=device), torch.randint(0, 1000, (32,), device=device))
    return _stepper(torch, model, optimizer, batch, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)), 32


def make_mlp12(torch, device):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(1024)
            self.up = nn.Linear(1024, 2048)
            self.down = nn.Linear(2048, 1024)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(12))).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = (torch.randn(64, 1024, device=device), torch.randn(64, 1024, device=device))
    return _stepper(torch, model, optimizer, batch, lambda m, x, y: nn.functional.mse_loss(m(x), y)), 64


def make_gpt2(torch, device):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=6, n_embd=768)
    model = transformers.GPT2LMHeadModel(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (8, 512), device=device)
    return _stepper(torch, model, optimizer, (tokens, tokens), lambda m, x, y: m(input_ids=x, labels=y).loss), 8


MAKERS = {"resnet50": make_resnet50, "mlp12": make_mlp12, "gpt2": make_gpt2}

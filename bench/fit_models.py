"""The models bench/fit.py measures gpuexp.fit on, each with a training step over random inputs:
torchvision's resnet50 and vit_b_16, GPT-2 and BERT built from their transformers configs (no
download), and a hand-written transformer. Imported by bench/fit.py and the GPU tests."""

# Batch sizes at which each step is asked to fit a budget smaller than its peak.
BATCH = {"resnet50": 64, "vit_b_16": 32, "gpt2": 8, "bert": 16, "transformer": 16}
MODELS = tuple(BATCH)
HAND_WRITTEN = dict(d_model=512, heads=8, layers=6, seq_len=512, vocab=8192)


def hand_written_transformer(torch, d_model, heads, layers, seq_len, vocab):
    """A decoder LM written out by hand: its blocks (``blocks.0``...) are what checkpointing wraps."""
    nn = torch.nn
    F = nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
            self.up, self.down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

        def forward(self, x):
            batch, length, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
            q, k, v = (t.view(batch, length, heads, d // heads).transpose(1, 2) for t in (q, k, v))
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1)
            scores = (q @ k.transpose(-2, -1)) / (d // heads) ** 0.5
            attended = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
            x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.position = nn.Parameter(torch.zeros(1, seq_len, d_model))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position[:, : tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return LM()


class Workload:
    """A model on the device with its AdamW optimizer, and ``loss(batch_size)`` on random inputs."""

    def __init__(self, torch, name, model, loss, checkpoint_switch=None):
        self.name, self.model, self.loss = name, model, loss
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.checkpoint_switch = checkpoint_switch

    def step(self, batch_size):
        """One training step: zero_grad, forward, loss, backward, optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss(batch_size).backward()
        self.optimizer.step()

    def accumulating_step(self, micro_batch):
        """The step as k micro-batches of ``micro_batch``, one optimizer step, for the same batch."""

        def step(batch_size):
            self.optimizer.zero_grad(set_to_none=True)
            k = batch_size // micro_batch
            for _ in range(k):
                (self.loss(micro_batch) / k).backward()
            self.optimizer.step()

        return step


def build(torch, name, device):
    """The named workload on ``device``; ImportError where its library is missing."""
    torch.manual_seed(0)
    F = torch.nn.functional
    if name in ("resnet50", "vit_b_16"):
        import torchvision

        model = getattr(torchvision.models, name)(weights=None).to(device)

        def loss(bs):
            images = torch.randn(bs, 3, 224, 224, device=device)
            return F.cross_entropy(model(images), torch.randint(0, 1000, (bs,), device=device))

        return Workload(torch, name, model, loss)
    if name in ("gpt2", "bert"):
        import transformers

        if name == "gpt2":
            config, seq_len = transformers.GPT2Config(), 1024
            model = transformers.GPT2LMHeadModel(config).to(device)
        else:
            config, seq_len = transformers.BertConfig(), 512
            model = transformers.BertForMaskedLM(config).to(device)

        def loss(bs):
            tokens = torch.randint(0, config.vocab_size, (bs, seq_len), device=device)
            return model(input_ids=tokens, labels=tokens).loss

        return Workload(torch, name, model, loss, checkpoint_switch="model.gradient_checkpointing_enable()")
    if name == "transformer":
        shape = HAND_WRITTEN
        model = hand_written_transformer(torch, **shape).to(device)

        def loss(bs):
            tokens = torch.randint(0, shape["vocab"], (bs, shape["seq_len"]), device=device)
            logits = model(tokens)
            return F.cross_entropy(logits.reshape(-1, shape["vocab"]), tokens.reshape(-1))

        return Workload(torch, name, model, loss)
    raise ValueError(f"no model {name!r}: pick from {', '.join(MODELS)}")

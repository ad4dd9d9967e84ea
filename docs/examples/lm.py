"""The language model the explain and estimate examples train: a transformer LM
(nn.TransformerEncoder, 4 layers, d_model 512, an 8192-token vocabulary) with AdamW."""

import torch

VOCABULARY = 8192
SEQUENCE = 256


def build(device):
    """The model and its optimizer; the encoder's template layer stays a name of its own, on the host."""
    layer = torch.nn.TransformerEncoderLayer(512, 8, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCABULARY, 512), torch.nn.TransformerEncoder(layer, 4), torch.nn.Linear(512, VOCABULARY)
    ).to(device)
    return layer, model, torch.optim.AdamW(model.parameters())


def train_step(model, optimizer, batch_size, device):
    """One training step on random tokens; the gradients are dropped at its end."""
    tokens = torch.randint(0, VOCABULARY, (batch_size, SEQUENCE), device=device)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return tokens, loss

"""Training data for the scripts: the generated "rule" language and byte-level text files.

Each rule sequence follows x[t+1] = (a * x[t] + b) mod vocab for a rule (a, b) drawn from
`RULES`, so a model can learn everything but the first token; no download is needed.
"""

import torch

RULES = [(3, 1), (5, 7), (7, 2), (11, 5)]
BYTE_VOCAB_SIZE = 256


def rule_batch(batch_size: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Sequences x[t+1] = (a x[t] + b) mod vocab, each with a random rule and start token."""
    rules = torch.tensor(RULES)[torch.randint(len(RULES), (batch_size,), generator=generator)]
    tokens = torch.empty(batch_size, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (batch_size,), generator=generator)
    for t in range(1, length):
        tokens[:, t] = (rules[:, 0] * tokens[:, t - 1] + rules[:, 1]) % vocab
    return tokens


def load_bytes(path: str) -> torch.Tensor:
    """The file at `path` as a 1-D int64 tensor of its bytes (tokens 0..255)."""
    with open(path, "rb") as handle:
        data = handle.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def byte_batch(data: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` windows of `length` consecutive bytes of `data` at random offsets."""
    if data.numel() < length:
        raise ValueError(f"the data file has {data.numel()} bytes; a sample needs seq_length + 1 = {length}.")
    starts = torch.randint(data.numel() - length + 1, (batch_size,), generator=generator)
    return data[starts.unsqueeze(1) + torch.arange(length)]

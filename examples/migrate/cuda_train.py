"""A small CUDA training script, written as for a GPU: a one-block causal transformer (RMSNorm,
scaled-dot-product attention, a SwiGLU MLP) learning a next-token rule on synthetic data, with
`.cuda()`, `torch.device("cuda:0")`, bf16 `torch.cuda.amp.autocast`, `torch.amp.GradScaler("cuda")`,
`torch.cuda.synchronize()`, `cudnn.benchmark` and AdamW.

    python cuda_train.py --device cpu                  # the reference run, on the CPU
    TORCH_TRANSFER_TO_NPU=1 python cuda_train.py       # unchanged, on npu (transfer_to_npu)
    python -m opennpu.migrate -i . -o /tmp/out         # or converted once, then run on npu

It prints the loss of every step (8 decimals) and the device the model trained on. See README.md.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default; the GPU) or cpu (the reference run)")
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()

VOCAB, SEQ, DIM, HEADS, BATCH = 32, 16, 32, 2, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(DIM), RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.gate = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, DIM))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.Sequential(Block(), Block())
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(self.embed(tokens))))


def batch(generator):
    """Sequences that follow t[i+1] = (3 t[i] + 1) mod VOCAB from a random start: learnable."""
    seq = torch.randint(0, VOCAB, (BATCH, 1), generator=generator).repeat(1, SEQ + 1)
    for i in range(1, SEQ + 1):
        seq[:, i] = (3 * seq[:, i - 1] + 1) % VOCAB
    return seq[:, :-1], seq[:, 1:]


def main():
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    use_cuda = args.device == "cuda"
    device = torch.device("cuda:0") if use_cuda else torch.device("cpu")

    model = TinyLM()
    if use_cuda:
        model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cuda" if use_cuda else "cpu")
    data = torch.Generator().manual_seed(0)

    t0 = time.time()
    for step in range(args.steps):
        x, y = batch(data)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if use_cuda:
            autocast = torch.cuda.amp.autocast(dtype=torch.bfloat16)
        else:
            autocast = torch.autocast("cpu", dtype=torch.bfloat16)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step:2d} loss {loss.item():.8f}")
    if use_cuda:
        torch.cuda.synchronize()
    print(f"trained on {next(model.parameters()).device} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

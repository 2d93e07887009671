"""A tiny decoder (RMSNorm, rotary embedding, SwiGLU, attention) in plain PyTorch."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class SwiGLU(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, value = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * value)


def attention(q, k, v):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    return torch.softmax(scores, dim=-1) @ v


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = SwiGLU(dim, 2 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        pos = torch.arange(s, device=tokens.device, dtype=torch.float32)
        freqs = torch.outer(pos, torch.ones(d // self.heads, device=tokens.device))
        q, k = apply_rotary_pos_emb(q, k, freqs.cos()[:, None], freqs.sin()[:, None])
        x = x + attention(q, k, v).reshape(b, s, d)
        return self.head(x + self.mlp(x))

"""End to end: a tiny MoE decoder stepped token by token the way vllm-ascend calls torch_npu
(npu_dynamic_quant + int8 npu_quant_matmul for the QKV projection, npu_apply_rotary_pos_emb,
npu_scatter_pa_kv_cache into a paged cache, npu_fused_infer_attention_score over it with a block
table, npu_moe_gating_top_k_softmax + npu_moe_token_permute + npu_grouped_matmul + npu_swiglu +
npu_moe_token_unpermute for the MLP), against the same model in plain PyTorch (dequantised
matmul, SDPA over a contiguous cache, a loop over experts)."""

import pytest
import torch
import torch.nn.functional as F

try:
    import torch_npu  # the name vllm-ascend calls the ops by
except ModuleNotFoundError:  # beside a visible CUDA GPU opennpu provides no torch_npu (docs/npu_device.md)
    import opennpu as torch_npu

H, N, KV, D, E, TOPK, I, VOCAB, LAYERS = 64, 4, 2, 16, 4, 2, 32, 50, 2
BLOCK, BLOCKS = 4, 16


def make_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    layers = []
    for _ in range(LAYERS):
        w_qkv = r(H, (N + 2 * KV) * D)
        scale = w_qkv.abs().amax(0) / 127  # per output channel
        layers.append(dict(
            norm1=1 + r(H), norm2=1 + r(H), w_qkv_q=torch.round(w_qkv / scale).to(torch.int8),
            w_qkv_scale=scale, w_o=r(N * D, H), w_gate=r(H, E), w1=r(E, H, 2 * I), w2=r(E, I, H)))
    return dict(embed=r(VOCAB, H), layers=layers, norm=1 + r(H), w_out=r(H, VOCAB))


def rope(pos):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)  # [B, D] (rotate-half layout)
    return ang.cos(), ang.sin()


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Ours:
    """Ascend-style decoding: paged caches [blocks, block_size, KV * D] ('Norm' layout)."""

    def __init__(self, w, batch, dev):
        self.w, self.dev = w, dev
        self.cache = [(torch.zeros(BLOCKS, BLOCK, KV, D, device=dev), torch.zeros(BLOCKS, BLOCK, KV, D, device=dev))
                      for _ in range(LAYERS)]
        perm = torch.randperm(BLOCKS, generator=torch.Generator().manual_seed(1))
        self.table = perm[:batch * (BLOCKS // batch)].view(batch, -1).to(torch.int32)

    def step(self, tokens, pos):
        w, dev, b = self.w, self.dev, tokens.shape[0]
        x = w["embed"].to(dev)[tokens.to(dev)]
        cos, sin = rope(pos)
        cos, sin = cos.view(b, 1, 1, D).to(dev), sin.view(b, 1, 1, D).to(dev)
        slots = (self.table[torch.arange(b), pos // BLOCK].long() * BLOCK + pos % BLOCK).to(torch.int32)
        for layer, (kc, vc) in zip(w["layers"], self.cache):
            h = torch_npu.npu_rms_norm(x, layer["norm1"].to(dev))[0]
            hq, hs = torch_npu.npu_dynamic_quant(h)
            qkv = torch_npu.npu_quant_matmul(hq, layer["w_qkv_q"].to(dev), layer["w_qkv_scale"].to(dev),
                                             pertoken_scale=hs, output_dtype=torch.bfloat16).float()
            q, k, v = qkv.split([N * D, KV * D, KV * D], dim=-1)
            q, k = q.reshape(b, 1, N, D).contiguous(), k.reshape(b, 1, KV, D).contiguous()
            q, k = torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BSND")
            torch_npu.npu_scatter_pa_kv_cache(k.view(b, KV, D), v.reshape(b, KV, D).contiguous(), kc, vc,
                                              slots.to(dev), cache_mode="Norm")
            attn, _ = torch_npu.npu_fused_infer_attention_score(
                q.reshape(b, 1, N * D), kc.view(BLOCKS, BLOCK, KV * D), vc.view(BLOCKS, BLOCK, KV * D),
                num_heads=N, num_key_value_heads=KV, input_layout="BSH", scale=D ** -0.5,
                block_table=self.table.to(dev), block_size=BLOCK, actual_seq_lengths_kv=(pos + 1).tolist())
            x = x + attn.reshape(b, N * D) @ layer["w_o"].to(dev)
            h = torch_npu.npu_rms_norm(x, layer["norm2"].to(dev))[0]
            probs, experts, _ = torch_npu.npu_moe_gating_top_k_softmax(h @ layer["w_gate"].to(dev), None, k=TOPK)
            permuted, order = torch_npu.npu_moe_token_permute(h, experts.to(torch.int64))
            ends = torch.bincount(experts.flatten().cpu(), minlength=E).cumsum(0).to(dev)
            up = torch_npu.npu_grouped_matmul([permuted], [layer["w1"].to(dev)], group_list=ends, split_item=3,
                                              group_type=0)[0]
            down = torch_npu.npu_grouped_matmul([torch_npu.npu_swiglu(up, -1)], [layer["w2"].to(dev)],
                                                group_list=ends, split_item=3, group_type=0)[0]
            x = x + torch_npu.npu_moe_token_unpermute(down, order, probs)
        return torch_npu.npu_rms_norm(x, w["norm"].to(dev))[0] @ w["w_out"].to(dev)


class Reference:
    """The same model in plain PyTorch: contiguous caches, per-token loops."""

    def __init__(self, w, batch):
        self.w = w
        self.k = [[[] for _ in range(batch)] for _ in range(LAYERS)]
        self.v = [[[] for _ in range(batch)] for _ in range(LAYERS)]

    def step(self, tokens, pos):
        w, b = self.w, tokens.shape[0]
        x = w["embed"][tokens]
        cos, sin = rope(pos)
        for li, layer in enumerate(w["layers"]):
            h = rms(x, layer["norm1"])
            hs = h.abs().amax(-1, keepdim=True) / 127
            hq = torch.round(h / hs).clamp(-128, 127)
            qkv = ((hq @ layer["w_qkv_q"].float()) * layer["w_qkv_scale"] * hs).bfloat16().float()
            q, k, v = qkv.split([N * D, KV * D, KV * D], dim=-1)
            q, k, v = q.view(b, N, D), k.view(b, KV, D), v.view(b, KV, D)
            q = q * cos[:, None] + rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            outs = []
            for s in range(b):
                self.k[li][s].append(k[s])
                self.v[li][s].append(v[s])
                ks, vs = torch.stack(self.k[li][s], 1), torch.stack(self.v[li][s], 1)  # [KV, L, D]
                outs.append(F.scaled_dot_product_attention(q[s][:, None], ks, vs, enable_gqa=True).reshape(N * D))
            x = x + torch.stack(outs) @ layer["w_o"]
            h = rms(x, layer["norm2"])
            top, experts = torch.softmax(h @ layer["w_gate"], -1).topk(TOPK, dim=-1)
            moe = torch.zeros_like(x)
            for t in range(b):
                for j in range(TOPK):
                    e = experts[t, j]
                    a, c = (h[t] @ layer["w1"][e]).chunk(2)
                    moe[t] += top[t, j] * ((F.silu(a) * c) @ layer["w2"][e])
            x = x + moe
        return rms(x, w["norm"]) @ w["w_out"]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("npu", marks=pytest.mark.skipif(not hasattr(torch, "npu"), reason="npu device off")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_tiny_moe_decoder_matches_plain_pytorch(device):
    torch.manual_seed(0)
    w = make_weights()
    batch, steps = 3, 9  # 9 positions span three 4-token blocks per sequence
    ours, ref = Ours(w, batch, device), Reference(w, batch)
    tokens = torch.randint(0, VOCAB, (batch,))
    for t in range(steps):
        pos = torch.full((batch,), t)
        got, expected = ours.step(tokens, pos).cpu(), ref.step(tokens, pos)
        # int8 activations may round a code differently where h sits on a tie: small tolerance
        torch.testing.assert_close(got, expected, atol=3e-3, rtol=3e-2)
        tokens = expected.argmax(-1)  # greedy, on the reference's choice so both see the same tokens

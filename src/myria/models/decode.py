"""Decoding with a KV cache: one forward per new token over every architecture myria trains.

Keys and values are cached per attention layer with their absolute positions, recurrent layers
keep their state; `myria generate` (myria.generate) drives it from a checkpoint.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from myria.errors import ConfigError


class KVCache:
    """What decoding keeps per layer: keys and values of attention layers (B, Hkv, T, D) with
    their absolute positions, and the recurrent state of retention, linear-attention, RG-LRU,
    Gated DeltaNet and Mamba-2 layers (constant size); `len` is the number of positions seen.

    A local-attention layer (sliding window, block-sparse) keeps only the keys a later query
    can still see: the global tokens and the last window - 1, so its memory stops growing.
    """

    def __init__(self):
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.pos: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict] = {}
        self.n = 0

    def append(self, layer: str, k: torch.Tensor, v: torch.Tensor, pos0: int = 0):
        """Keys and values of every cached position and this call's, with their positions."""
        pos = torch.arange(pos0, pos0 + k.shape[2], device=k.device)
        if layer in self.k:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
            pos = torch.cat([self.pos[layer], pos])
        self.k[layer], self.v[layer], self.pos[layer] = k, v, pos
        return k, v, pos

    def trim(self, layer: str, window: int, n_global: int, next_pos: int) -> None:
        """Drop the keys no query from `next_pos` on can see (window > 0)."""
        keep = (self.pos[layer] < n_global) | (self.pos[layer] > next_pos - window)
        if not bool(keep.all()):
            self.k[layer], self.v[layer] = self.k[layer][:, :, keep], self.v[layer][:, :, keep]
            self.pos[layer] = self.pos[layer][keep]

    def __len__(self) -> int:
        return self.n

    def nbytes(self) -> int:
        """Bytes held: keys, values and recurrent states."""
        ts = [*self.k.values(), *self.v.values()]
        ts += [t for st in self.state.values() for t in st.values()
               if isinstance(t, torch.Tensor)]
        ts += [t for st in self.state.values() for tup in st.values() if isinstance(tup, tuple)
               for t in tup]
        return sum(t.numel() * t.element_size() for t in ts)


def _attend(att, x: torch.Tensor, cache: KVCache, name: str, rope, pos0: int) -> torch.Tensor:
    from myria.models.attention import BlockSparseAttention, apply_rope
    from myria.models.linear_attention import LinearAttention

    b, s, _ = x.shape
    q = att.wq(x).view(b, s, -1, att.head_dim).transpose(1, 2)
    k = att.wk(x).view(b, s, -1, att.head_dim).transpose(1, 2)
    v = att.wv(x).view(b, s, -1, att.head_dim).transpose(1, 2)
    if att.use_rope:
        cos, sin = rope[0][pos0:pos0 + s], rope[1][pos0:pos0 + s]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if isinstance(att.core, LinearAttention):
        o = _linear_recurrent(att.core, q, k, v, cache.state.setdefault(name, {}))
        return att.wo(o.transpose(1, 2).reshape(b, s, -1))
    window = att.core.window
    n_global = att.core.n_global if isinstance(att.core, BlockSparseAttention) else 0
    k, v, kpos = cache.append(name, k, v, pos0)
    qpos = torch.arange(pos0, pos0 + s, device=x.device).unsqueeze(1)
    kp = kpos.unsqueeze(0)
    mask = kp <= qpos
    if window:
        mask &= (qpos - kp < window) | (kp < n_global) | (qpos < n_global)
        cache.trim(name, window, n_global, pos0 + s)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                       enable_gqa=k.shape[1] != q.shape[1])
    return att.wo(o.transpose(1, 2).reshape(b, s, -1))


def _linear_recurrent(core, q, k, v, state: dict) -> torch.Tensor:
    """Linear attention against its (S, z) state: one step per token after the prompt."""
    from myria.models.linear_attention import (
        feature_map,
        linear_attention_chunked,
        linear_attention_step,
    )

    q, k = feature_map(q, core.kind), feature_map(k, core.kind)
    if q.shape[2] == 1 and "sz" in state:
        o, state["sz"] = linear_attention_step(q, k, v, state["sz"])
    else:
        o, state["sz"] = linear_attention_chunked(q, k, v, core.chunk, state.get("sz"), True)
    return o


@torch.no_grad()
def forward_cached(model, tokens: torch.Tensor, cache: KVCache, rope=None) -> torch.Tensor:
    """Logits (B, S, V) of `tokens` (B, S) at positions len(cache).., extending the cache."""
    pos0 = len(cache)
    h = model.tok_embeddings(tokens)
    if model.pos_embeddings is not None:
        h = h + model.pos_embeddings(torch.arange(pos0, pos0 + tokens.shape[1],
                                                  device=tokens.device))
    for name, layer in model.layers.items():
        n = layer.attention_norm(h)
        mixer = layer.attention
        if hasattr(mixer, "forward_recurrent"):   # retention, RG-LRU, Gated DeltaNet, Mamba-2
            a = mixer.forward_recurrent(n, rope, cache.state.setdefault(name, {}), pos0)
        else:
            a = _attend(mixer, n, cache, name, rope, pos0)
        if layer.parallel:
            h = h + a + layer.feed_forward(n)
        else:
            h = h + a
            h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.n = pos0 + tokens.shape[1]
    return model.output(model.norm(h))


def rope_for(model, length: int):
    """RoPE tables long enough for `length` positions (beyond the training length too)."""
    if model.cfg.arch == "gpt":
        return None
    if model.rope_cos.shape[0] >= length:
        return model.rope_cos, model.rope_sin
    from myria.models.transformer import rope_for

    return rope_for(model.cfg, length)


def pick(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    """The next token from the last position's logits (1-D, vocabulary)."""
    logits = logits.float().cpu()  # the sampler's generator lives on the CPU, on every device
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, seed: int = 0, eos: int | None = None) -> list[int]:
    """The new token ids after `prompt_ids` (stops after `eos`, which is included)."""
    model.eval()
    cfg = model.cfg
    total = len(prompt_ids) + max_new_tokens
    if cfg.arch == "gpt" and total > cfg.seq_len:
        raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens "
                          f"{max_new_tokens} = {total} exceeds the GPT model's {cfg.seq_len} "
                          "learned positions")
    rope = rope_for(model, total)
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache()
    dev = next(model.parameters()).device
    if rope is not None:
        rope = tuple(r.to(dev) for r in rope)
    logits = forward_cached(model, torch.tensor([prompt_ids], device=dev), cache, rope)[0, -1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        t = pick(logits, temperature, top_k, gen)
        out.append(t)
        if eos is not None and t == eos:
            break
        logits = forward_cached(model, torch.tensor([[t]], device=dev), cache, rope)[0, -1]
    return out

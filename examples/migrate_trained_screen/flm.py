"""Screening (issue 20): a functional post->pre blend of the demo CharLM, for screening endpoints/schedules fast.

Sublayers k = 0..2L-1 (attn_0, mlp_0, attn_1, ...). Site norm S_k: the norm after sublayer k in the post-norm
forward (ln1 / ln2 of the block). Entry norm E_k: the norm the branch reads at blend 1.
Per sublayer blend a_k; final norm blend af.
"""
import torch
from torch.nn import functional as F

D = 64


def load(ckpt_path):
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    sd = {k[len("model."):]: v for k, v in ck["state_dict"].items() if k.startswith("model.")}
    return ck, sd


def n_layers(sd):
    return 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))


def ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def attn(p, i, x, heads):
    b, t, d = x.shape
    q, k, v = F.linear(x, p[f"blocks.{i}.attn.qkv.weight"], p[f"blocks.{i}.attn.qkv.bias"]).split(d, dim=2)
    q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(y.transpose(1, 2).reshape(b, t, d), p[f"blocks.{i}.attn.proj.weight"], p[f"blocks.{i}.attn.proj.bias"])


def mlp(p, i, x):
    h = F.gelu(F.linear(x, p[f"blocks.{i}.mlp.fc.weight"], p[f"blocks.{i}.mlp.fc.bias"]))
    return F.linear(h, p[f"blocks.{i}.mlp.out.weight"], p[f"blocks.{i}.mlp.out.bias"])


def site_name(k):
    return f"blocks.{k // 2}.ln{1 + k % 2}"


def forward(p, idx, a, af, entry, final, heads=4, c=None, stats=None):
    """a: list of 2L blends (floats or 0-dim tensors); entry: list of 2L (w, b) or None (identity);
    final: (w, b); c: optional per-sublayer branch scale at blend 1."""
    t = idx.shape[1]
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][:t]
    L = len(a) // 2
    for k in range(2 * L):
        ak = a[k]
        e = entry[k]
        u = x if e is None else (1 - ak) * x + ak * ln(x, *e)
        f = attn(p, k // 2, u, heads) if k % 2 == 0 else mlp(p, k // 2, u)
        if c is not None:
            f = ((1 - ak) + ak * c[k]) * f
        h = x + f
        s = site_name(k)
        if stats is not None:
            stats.append(h.float().std(-1).mean().item())
        x = (1 - ak) * ln(h, p[s + ".weight"], p[s + ".bias"]) + ak * h
    x = (1 - af) * x + af * ln(x, *final)
    return F.linear(x, p["head.weight"], p["head.bias"])


def entries(p, L, kind, first=None):
    """E0 ('own'): branch k reads S_k (what convert does). E1 ('preceding'): branch k reads S_{k-1};
    the first branch reads `first` ('fresh' LN or None = identity)."""
    out = []
    for k in range(2 * L):
        if kind == "own":
            s = site_name(k)
            out.append((p[s + ".weight"], p[s + ".bias"]))
        elif kind == "preceding":
            if k == 0:
                out.append(None if first is None else (torch.ones(D), torch.zeros(D)))
            else:
                s = site_name(k - 1)
                out.append((p[s + ".weight"], p[s + ".bias"]))
    return out


def final_norm(p, L, kind):
    s = site_name(2 * L - 1)
    if kind == "trained":
        return (p[s + ".weight"], p[s + ".bias"])
    return (torch.ones(D), torch.zeros(D))


def forward_rescaled(p, idx, a, af, entry, final, C, heads=4, beta_fold=False, interp="geo"):
    """The reparameterised blend: stream scale D_k = C_k^a (C_0 = 1, C_k = prod_{i<k} r_i, len(C) = 2L+1).
    u = (1-a) x / D_k + a E_k(x);  h = x + D_k F(u);  out = (1-a) D_{k+1} S_k(h) + a (h [+ D_{k+1} beta_k]).
    final: (1-af) s / D_2L + af N_f(s). Exact post-norm at a=0 (D=1), pre-norm with branch scales C_k at a=1."""
    t = idx.shape[1]
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][:t]
    L2 = len(a)

    def D(k, ak):
        if interp == "geo":
            return C[k] ** ak
        return (1 - ak) + ak * C[k]
    for k in range(L2):
        ak = a[k]
        e = entry[k]
        dk, dk1 = D(k, ak), D(k + 1, ak)
        u = (1 - ak) * (x / dk) + ak * (x if e is None else ln(x, *e))
        f = attn(p, k // 2, u, heads) if k % 2 == 0 else mlp(p, k // 2, u)
        h = x + dk * f
        s = site_name(k)
        pre = h + dk1 * p[s + ".bias"] if beta_fold else h
        x = (1 - ak) * (dk1 * ln(h, p[s + ".weight"], p[s + ".bias"])) + ak * pre
    dl = D(L2, af)
    x = (1 - af) * (x / dl) + af * ln(x, *final)
    return F.linear(x, p["head.weight"], p["head.bias"])


def site_stats(p, idx, L2=24):
    st = []
    forward(p, idx, [0.0] * L2, 0.0, [None] * L2, (None, None), stats=st)
    return st


def scales(p, idx, L2=24, kind="sigma/gamma"):
    sig = torch.tensor(site_stats(p, idx, L2))
    gam = torch.stack([p[site_name(k) + ".weight"] for k in range(L2)]).abs().mean(1)
    r = sig / gam if kind == "sigma/gamma" else sig
    C = [torch.ones(())]
    for k in range(L2):
        C.append(C[-1] * r[k])
    return C

"""A small GPT trained through torch.compile(backend="lighthouse"), beside eager torch.

    python examples/train_gpt.py [--steps 20] [--no-inductor] [--size small|default]

Character-level language model on this project's README (the text ships with it): token and
position embeddings, `layers` blocks of pre-LayerNorm causal self-attention
(F.scaled_dot_product_attention) and a tanh-GELU MLP, a final LayerNorm, a linear head and
F.cross_entropy. The same initial weights and batches are trained with AdamW `steps` times
eagerly, with torch.compile(backend="lighthouse") and (unless --no-inductor) with
torch.compile's default backend, inductor, each taking every step in turn. It prints the loss curves (eager and lighthouse
must agree to --rtol at every step, else it exits 1), the tokens per second of each (median
step after the first two, which compile), the compile time, and what each graph part was
compiled by: the attention, linear cross-entropy (head and loss), matmul or generic family, or torch (a fallback,
with its reason).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# As in lighthouse.bench: torch's OpenMP threads (libgomp) spin about 200 us after a parallel
# region, as lighthouse's do, instead of milliseconds on the cores the next kernel needs
# (lighthouse's, on the OpenMP runtime it compiles against, or inductor's); read when torch
# loads libgomp, so before the import. The same for eager, lighthouse and inductor.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TEXT = Path(__file__).resolve().parent.parent / "README.md"


@dataclass(frozen=True)
class Config:
    vocab: int
    block: int = 64        # context length T
    width: int = 128       # C
    heads: int = 4
    layers: int = 2
    batch: int = 16


SIZES = {"default": dict(block=64, width=128, heads=4, layers=2, batch=16),
         "small": dict(block=32, width=64, heads=4, layers=2, batch=4)}


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(cfg.block, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def batches(text: str, cfg: Config, steps: int, seed: int = 0):
    """`steps` batches of (input, target) windows of the text, the same for every run."""
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - cfg.block - 1, (cfg.batch,), generator=g)
        x = torch.stack([data[s:s + cfg.block] for s in starts])
        y = torch.stack([data[s + 1:s + cfg.block + 1] for s in starts])
        out.append((x, y))
    return out


class Trainer:
    """One model trained with AdamW, calling step_fn(x, y) -> loss; records each step's loss
    and seconds."""

    def __init__(self, model: nn.Module, step_fn):
        self.step_fn = step_fn
        self.opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self, x, y) -> None:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.step_fn(x, y)
        loss.backward()
        self.opt.step()
        self.seconds.append(time.perf_counter() - start)
        self.losses.append(loss.item())


def train(trainers: dict[str, Trainer], data) -> None:
    """Every trainer takes each step in turn, the order rotating from step to step, so that
    a load on the machine falls on all of them alike."""
    names = list(trainers)
    for i, (x, y) in enumerate(data):
        for name in names[i % len(names):] + names[:i % len(names)]:
            trainers[name].step(x, y)


def tokens_per_second(cfg: Config, seconds: list[float]) -> float:
    steady = seconds[2:] or seconds
    return cfg.batch * cfg.block / statistics.median(steady)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument("--no-inductor", action="store_true", help="skip torch.compile's inductor")
    p.add_argument("--rtol", type=float, default=1e-3,
                   help="largest relative difference of the losses (eager vs lighthouse)")
    p.add_argument("--threads", type=int, help="torch and lighthouse threads (default: all)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    text = TEXT.read_text()
    cfg = Config(vocab=len(set(text)), **SIZES[args.size])
    data = batches(text, cfg, args.steps)
    torch.manual_seed(0)
    initial = GPT(cfg).state_dict()

    def fresh() -> GPT:
        model = GPT(cfg)
        model.load_state_dict(initial)
        return model

    eager, ours = fresh(), fresh()
    options = {"threads": args.threads} if args.threads else {}
    trainers = {"eager": Trainer(eager, eager),
                "lighthouse": Trainer(ours, torch.compile(ours, backend="lighthouse",
                                                          options=options))}
    if not args.no_inductor:
        theirs = fresh()
        trainers["inductor"] = Trainer(theirs, torch.compile(theirs))
    train(trainers, data)
    runs = {name: (t.losses, t.seconds) for name, t in trainers.items()}

    print(f"GPT: {cfg.layers} blocks, width {cfg.width}, {cfg.heads} heads, context "
          f"{cfg.block}, batch {cfg.batch}, vocab {cfg.vocab}; {args.steps} AdamW steps on "
          f"{TEXT.name}")
    print(f"{'step':>4} " + " ".join(f"{name:>12}" for name in runs) + "   rel diff")
    worst = 0.0
    for i in range(args.steps):
        e, o = runs["eager"][0][i], runs["lighthouse"][0][i]
        rel = abs(o - e) / max(abs(e), 1e-30)
        worst = max(worst, rel if math.isfinite(rel) else math.inf)
        print(f"{i:>4} " + " ".join(f"{runs[n][0][i]:>12.6f}" for n in runs) + f"   {rel:.2e}")
    print()
    for name, (_, seconds) in runs.items():
        print(f"{name:>10}: {tokens_per_second(cfg, seconds):>10.0f} tokens/s "
              f"(first step {seconds[0]:.1f} s)")
    _print_parts()
    if worst > args.rtol:
        print(f"FAILED: the lighthouse loss differs from eager by {worst:.2e} relative "
              f"(> {args.rtol:g})", file=sys.stderr)
        return 1
    print(f"losses agree with eager to {worst:.1e} relative (<= {args.rtol:g})")
    return 0


def _print_parts() -> None:
    from lighthouse.dynamo import RECORDS

    print("\nwhat compiled each graph (lighthouse):")
    for i, record in enumerate(RECORDS):
        print(f"graph {i}: compiled in {record.seconds:.1f} s")
        for role, graph in record.graphs.items():
            print(f" {role}:")
            print(graph.describe())


if __name__ == "__main__":
    sys.exit(main())

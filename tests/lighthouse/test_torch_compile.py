"""torch.compile(backend="lighthouse") and lighthouse.compile_module against eager torch:
forward and backward graphs of attention, cross-entropy and an MLP, which family compiled
each part, fallbacks, recompilation, options, bad inputs and the entry point."""

import logging
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import lighthouse
from lighthouse import dynamo
from lighthouse.errors import LighthouseError

from ..conftest import ROOT


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    dynamo.RECORDS.clear()
    yield
    torch._dynamo.reset()


def families(record=None) -> dict[str, list]:
    """role -> [(part kind, family or None)] of the last compile (or `record`)."""
    record = record or dynamo.RECORDS[-1]
    return {role: [(r.kind, r.family) for r in graph.reports if r.kind != "moves"]
            for role, graph in record.graphs.items()}


def leaves(*tensors, dtype=torch.float32):
    return [t.to(dtype).detach().requires_grad_(True) for t in tensors]


def assert_close(got, want, dtype=torch.float32):
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def forward_backward(fn, inputs, seed_shape_like=0):
    """fn(*inputs), and the gradients of sum(out * fixed weights) for the inputs."""
    out = fn(*inputs)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    return out.detach(), grads


class Attention(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kwargs)


@pytest.mark.parametrize("kwargs, kv_heads, dtype", [
    (dict(is_causal=True), 4, torch.float32),
    (dict(scale=0.3), 4, torch.float32),
    (dict(is_causal=True, enable_gqa=True), 2, torch.float32),
    (dict(is_causal=True), 4, torch.bfloat16),
])
def test_attention_forward_and_backward(kwargs, kv_heads, dtype):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 48, 16)
    k, v = torch.randn(2, kv_heads, 48, 16), torch.randn(2, kv_heads, 48, 16)
    eager = Attention(**kwargs)
    want = forward_backward(eager, leaves(q, k, v, dtype=dtype))
    got = forward_backward(torch.compile(eager, backend="lighthouse"), leaves(q, k, v, dtype=dtype))
    assert_close(got[0], want[0], dtype)
    for g, w in zip(got[1], want[1]):
        assert_close(g, w, dtype)
    parts = families()
    assert ("attention", "attention") in parts["forward"]
    assert ("attention_backward", "attention") in parts["backward"]


def test_attention_with_a_bool_mask_and_fully_masked_rows():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 32, 16) for _ in range(3))
    mask = torch.rand(1, 1, 32, 32) > 0.3
    mask[..., 5, :] = False  # a fully masked row: output and gradients 0 there, as torch

    class Masked(nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    want = forward_backward(lambda *t: Masked()(*t, mask), leaves(q, k, v))
    compiled = torch.compile(Masked(), backend="lighthouse")
    got = forward_backward(lambda *t: compiled(*t, mask), leaves(q, k, v))
    assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        assert_close(g, w)
    assert ("attention_backward", "attention") in families()["backward"]


@pytest.mark.parametrize("options", [
    dict(reduction="mean"),
    dict(reduction="none", ignore_index=3, label_smoothing=0.1),
    dict(reduction="sum", weight=True),
])
def test_cross_entropy_forward_and_backward(options):
    torch.manual_seed(0)
    logits = torch.randn(24, 37) * 4
    target = torch.randint(0, 37, (24,))
    target[:3] = options.get("ignore_index", -100)
    weight = torch.rand(37) + 0.5 if options.pop("weight", False) else None

    def loss(x):
        return F.cross_entropy(x, target, weight, **options)

    want = forward_backward(loss, leaves(logits))
    got = forward_backward(torch.compile(loss, backend="lighthouse"), leaves(logits))
    assert_close(got[0], want[0])
    assert_close(got[1][0], want[1][0])
    assert families()["forward"] == [("cross_entropy", "cross_entropy")]


def test_cross_entropy_without_gradients_is_the_forward_alone():
    torch.manual_seed(0)
    logits, target = torch.randn(16, 50), torch.randint(0, 50, (16,))
    compiled = torch.compile(lambda x: F.cross_entropy(x, target), backend="lighthouse")
    with torch.no_grad():
        got = compiled(logits)
    assert_close(got, F.cross_entropy(logits, target))
    assert families() == {"inference": [("cross_entropy", "cross_entropy")]}


class LmHead(nn.Module):
    """An LM head and its loss as GPT code writes them; `tied`: W is the embedding's."""

    def __init__(self, width=32, vocab=101, bias=True, tied=False, **loss_options):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=bias)
        if tied:
            self.head.weight = self.embed.weight
        self.loss_options = loss_options

    def forward(self, idx, target, with_logits=False):
        logits = self.head(torch.tanh(self.embed(idx)))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1),
                               **self.loss_options)
        return (loss, logits) if with_logits else loss


def lm_batch(vocab=101, ignored=3):
    torch.manual_seed(1)
    idx, target = torch.randint(0, vocab, (2, 13)), torch.randint(0, vocab, (2, 13))
    target[0, :ignored] = -100
    return idx, target


def grads_of(model, *inputs, dtype=torch.float32, **kwargs):
    model.zero_grad()
    out = model(*inputs, **kwargs)
    loss = out[0] if isinstance(out, tuple) else out
    (loss + (out[1].float().square().mean() if isinstance(out, tuple) else 0)).backward()
    return [loss] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kwargs, dtype", [
    (dict(), torch.float32),
    (dict(bias=False, reduction="sum", label_smoothing=0.1), torch.float32),
    (dict(tied=True), torch.float32),
    (dict(weight=True), torch.float32),
    (dict(), torch.bfloat16),
])
def test_lm_head_and_loss_are_one_linear_cross_entropy_part(kwargs, dtype):
    if kwargs.pop("weight", False):
        kwargs["weight"] = torch.rand(101) + 0.5
    model = LmHead(**kwargs).to(dtype)
    want = grads_of(model, *lm_batch())
    got = grads_of(torch.compile(model, backend="lighthouse"), *lm_batch())
    for g, w in zip(got, want):
        assert_close(g.float(), w.float(), dtype)
    assert ("linear_cross_entropy", "linear_cross_entropy") in families()["forward"]


def test_lm_head_whose_logits_are_also_returned_gets_both_gradients():
    model = LmHead()
    want = grads_of(model, *lm_batch(), with_logits=True)
    got = grads_of(torch.compile(model, backend="lighthouse"), *lm_batch(), with_logits=True)
    for g, w in zip(got, want):
        assert_close(g, w)
    assert ("linear_cross_entropy", "linear_cross_entropy") in families()["forward"]


def test_lm_loss_per_token_with_gradients_is_the_cross_entropy_family():
    model = LmHead(reduction="none")
    idx, target = lm_batch()
    want = model(idx, target)
    got = torch.compile(model, backend="lighthouse")(idx, target)
    assert_close(got, want)
    got.sum().backward()
    assert ("cross_entropy", "cross_entropy") in families()["forward"]


def test_lm_loss_in_inference_is_the_linear_cross_entropy_forward():
    model = LmHead(reduction="none")
    with torch.no_grad():
        want = model(*lm_batch())
        got = torch.compile(model, backend="lighthouse")(*lm_batch())
    assert_close(got, want)
    assert ("linear_cross_entropy", "linear_cross_entropy") in families()["inference"]


def mlp(width=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"),
                         nn.Linear(4 * width, width))


def test_mlp_forward_and_backward_fill_parameter_gradients():
    model, x = mlp(), torch.randn(8, 32)
    reference = mlp()
    compiled = torch.compile(model, backend="lighthouse")
    compiled(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close(p.grad, q.grad)
    parts = families()
    assert parts["forward"] == [("matmul", "matmul")] * 2  # each with its bias (and GELU)
    assert [p for p in parts["backward"] if p[0] == "matmul"] == [("matmul", "matmul")] * 3


def test_a_graph_torch_mlir_cannot_import_runs_in_torch_with_one_note(caplog):
    class Eig(nn.Module):
        def forward(self, x):
            return torch.linalg.eigvalsh(x @ x.T) + 1

    x = torch.randn(4, 4)
    compiled = torch.compile(Eig(), backend="lighthouse")
    with caplog.at_level(logging.WARNING, logger="lighthouse"):
        got = compiled(x)
        compiled(x)
    assert_close(got, Eig()(x))
    notes = [r.getMessage() for r in caplog.records if r.name == "lighthouse"]
    assert len(notes) == 1 and "runs in torch" in notes[0] and "eigh" in notes[0], notes
    assert (None in [family for _, family in families()["inference"]])


def test_strict_raises_instead_of_falling_back():
    compiled = torch.compile(lambda x: torch.linalg.eigvalsh(x), backend="lighthouse",
                             options={"strict": True})
    with pytest.raises(Exception, match="eigh"):
        compiled(torch.eye(4))


def test_unknown_option_is_an_error():
    compiled = torch.compile(lambda x: x + 1, backend="lighthouse", options={"query_tyle": 4})
    with pytest.raises(Exception, match="query_tyle"):
        compiled(torch.ones(3))


def test_a_new_shape_compiles_again():
    model = mlp(16)
    compiled = torch.compile(model, backend="lighthouse", dynamic=False)
    for rows in (4, 6):
        x = torch.randn(rows, 16)
        with torch.no_grad():
            assert_close(compiled(x), model(x))
    assert len(dynamo.RECORDS) == 2


def test_compile_module_specializes_and_reads_parameters_at_call_time():
    model = mlp(16)
    fast = lighthouse.compile_module(model, torch.randn(4, 16))
    assert len(fast.records) == 1
    x = torch.randn(4, 16)
    assert_close(fast(x), model(x).detach())
    with torch.no_grad():
        model[0].weight.mul_(2)  # an optimizer's in-place update
    assert_close(fast(x), model(x).detach())
    assert len(fast.records) == 1
    assert_close(fast(torch.ones(3, 16)), model(torch.ones(3, 16)).detach())
    assert len(fast.records) == 2


def test_compile_module_backward_trains_like_eager():
    model, reference = mlp(16), mlp(16)
    fast = lighthouse.compile_module(model, torch.randn(4, 16), backward=True)
    x = torch.randn(4, 16)
    for m in (model, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            (fast if m is model else m)(x).square().mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert_close(p, q)
    assert set(fast.records[0].graphs) == {"forward", "backward"}


@pytest.mark.parametrize("bad, message", [
    ("text", "argument 0: str is not a tensor or a number"),
    (torch.ones(4, 16, dtype=torch.complex64), "argument 0: dtype complex64"),
])
def test_compile_module_names_the_argument_it_cannot_take(bad, message):
    fast = lighthouse.compile_module(mlp(16))
    with pytest.raises(LighthouseError, match=message):
        fast(bad)


def test_compile_module_rejects_what_is_not_a_module():
    with pytest.raises(LighthouseError, match="takes a torch.nn.Module"):
        lighthouse.compile_module(lambda x: x)


def test_backend_is_found_through_its_entry_point_without_importing_lighthouse():
    code = ("import sys, torch\n"
            "assert 'lighthouse' in torch._dynamo.list_backends()\n"
            "m = torch.nn.Linear(8, 4)\n"
            "x = torch.randn(3, 8)\n"
            "with torch.no_grad():\n"
            "    got = torch.compile(m, backend='lighthouse')(x)\n"
            "torch.testing.assert_close(got, m(x).detach(), rtol=1e-5, atol=1e-5)\n"
            "print('lighthouse.dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True"


def test_training_example_matches_eager():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--size", "small",
                        "--steps", "3", "--no-inductor"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "losses agree with eager" in r.stdout
    assert "attention_backward" in r.stdout and "linear_cross_entropy" in r.stdout


def test_kernels_are_loaded_from_the_disk_cache_by_another_process(tmp_path):
    code = ("import torch, lighthouse\n"
            "torch.manual_seed(0)\n"
            "m = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))\n"
            "x = torch.randn(5, 16)\n"
            "fast = lighthouse.compile_module(m, x)\n"
            "torch.testing.assert_close(fast(x), m(x).detach(), rtol=1e-5, atol=1e-5)\n"
            "reports = [r for g in fast.records[0].graphs.values() for r in g.reports if r.family]\n"
            "print(sum(r.from_disk for r in reports), len(reports))\n")
    env = {**__import__("os").environ, "LIGHTHOUSE_CACHE_DIR": str(tmp_path), "LIGHTHOUSE_CACHE": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=env, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    first, second = (r.stdout.split() for r in runs)
    assert first[0] == "0" and second[0] == second[1] != "0"
    assert list(tmp_path.iterdir())


def test_attention_with_a_float_mask_that_needs_its_gradient():
    """torch would take its math backend; traced as lighthouse::attention_masked, the forward
    and the backward (with the mask's gradient) are the attention family's kernels."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 40, 16) for _ in range(3))
    mask = torch.randn(1, 2, 40, 40)
    mask[..., 7, :] = float("-inf")

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    want = forward_backward(attend, leaves(q, k, v, mask))
    got = forward_backward(torch.compile(attend, backend="lighthouse"), leaves(q, k, v, mask))
    assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        assert_close(g, w)
    parts = families()
    assert ("attention", "attention") in parts["forward"]
    assert ("attention_backward", "attention") in parts["backward"]


def test_dropout_draws_a_new_mask_each_call_and_its_backward_uses_it():
    """Dropout in training: no bitwise match with torch's random stream (inductor has none
    either), but dropout's law: a fresh mask per call, drop rate p, kept values scaled by
    1 / (1 - p), the backward through the same mask."""
    compiled = torch.compile(nn.Dropout(0.3), backend="lighthouse")
    x = torch.ones(100, 100, requires_grad=True)
    a, b = compiled(x), compiled(x)
    assert not torch.equal(a, b)
    for out in (a, b):
        assert abs((out == 0).float().mean().item() - 0.3) < 0.03
        kept = out[out != 0]
        torch.testing.assert_close(kept, torch.full_like(kept, 1 / 0.7))
    a.sum().backward()
    assert torch.equal(x.grad, a.detach())


class HandWritten(nn.Module):
    """MinGPT's attention: a causal buffer, masked_fill, softmax, P V."""

    def __init__(self, length=64):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(length, length)).view(1, 1, length, length))

    def forward(self, q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def test_attention_written_by_hand_is_one_attention_part():
    torch.manual_seed(0)
    model = HandWritten()
    q, k, v = (torch.randn(2, 3, 64, 16) for _ in range(3))
    compiled = torch.compile(model, backend="lighthouse")
    with torch.no_grad():
        assert_close(compiled(q, k, v), model(q, k, v))
    assert ("attention", "attention") in families()["inference"]
    # training keeps the probabilities for the backward: the parts stay apart, still right
    torch._dynamo.reset()
    want = forward_backward(model, leaves(q, k, v))
    got = forward_backward(torch.compile(model, backend="lighthouse"), leaves(q, k, v))
    for g, w in zip(got[1], want[1]):
        assert_close(g, w)

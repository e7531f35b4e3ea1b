"""trainer.logprobs against the full log-softmax, in float64: values, gradients, grammar masks, a real PEFT model."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from trainer.batch import TrainSequence, pack_sequences
from trainer.logprobs import chunked_token_logprobs, policy_token_logprobs

N, H, V = 6, 8, 70  # V not a multiple of 32: the last bitmask word is partly padding

# Allowed tokens of three grammar masks, by hand; the last two reach into the last, partial word.
ALLOWED = [{0, 5, 31, 32, 69}, {3, 4, 40, 41, 42, 64}, set(range(60, 70))]


def _pack(allowed: list[set[int]], vocab: int) -> Tensor:
    """xgrammar's layout, bit by bit in Python: bit j of word w set <=> token 32 w + j allowed."""
    words = [[0] * ((vocab + 31) // 32) for _ in allowed]
    for row, tokens in zip(words, allowed, strict=True):
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
    # int32 words: bit 31 makes the word negative.
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in row] for row in words], dtype=torch.int32)


def _reference(hidden: Tensor, weight: Tensor, y: Tensor, index: Tensor | None = None) -> Tensor:
    """torch.log_softmax over the full logits; a constrained row's over its ALLOWED set only."""
    logits = hidden @ weight.T
    if index is not None:
        allowed = torch.ones_like(logits, dtype=torch.bool)
        for row, m in enumerate(index.tolist()):
            if m >= 0:
                allowed[row] = False
                allowed[row, sorted(ALLOWED[m])] = True
        logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, y[..., None])[..., 0]


def _inputs(masked: bool, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """hidden (requires grad), weight, tokens; with masked: rows 1, 2, 4 under ALLOWED[0], [2], [1]."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, dtype=torch.float64, generator=g).requires_grad_()
    weight = torch.randn(V, H, dtype=torch.float64, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    if not masked:
        return hidden, weight, y, None, None
    index = torch.tensor([-1, 0, 2, -1, 1, -1])
    for row, m in enumerate(index.tolist()):
        if m >= 0:
            y[row] = sorted(ALLOWED[m])[row % len(ALLOWED[m])]  # a token its grammar allows
    return hidden, weight, y, index, _pack(ALLOWED, V)


def test_pack_is_xgrammars_layout() -> None:
    # {0, 5, 31, 32, 69}: word 0 = bits 0, 5, 31 (negative as int32), word 1 = bit 0, word 2 = bit 5 (69 = 64 + 5).
    assert _pack(ALLOWED[:1], V).tolist() == [[1 + 32 - 2**31, 1, 32]]


@pytest.mark.parametrize("masked", [False, True], ids=["free", "grammar"])
@pytest.mark.parametrize("chunk_size", [1, 4, N, N + 5])
def test_values_and_gradients_equal_the_full_log_softmax(chunk_size: int, masked: bool) -> None:
    hidden, weight, y, index, bitmask = _inputs(masked)
    got = chunked_token_logprobs(hidden, weight, y, chunk_size=chunk_size, allowed_index=index, allowed_bitmask=bitmask)
    expected = _reference(hidden, weight, y, index)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    upstream = torch.linspace(-1.0, 2.0, N, dtype=torch.float64)  # a different weight per row
    (grad,) = torch.autograd.grad((got * upstream).sum(), hidden)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum(), hidden)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True], ids=["free", "grammar"])
def test_gradcheck(masked: bool) -> None:
    hidden, weight, y, index, bitmask = _inputs(masked, seed=1)
    assert torch.autograd.gradcheck(
        lambda h: chunked_token_logprobs(h, weight, y, chunk_size=4, allowed_index=index, allowed_bitmask=bitmask),
        (hidden,),
    )


def test_masked_row_is_the_softmax_over_its_allowed_tokens() -> None:
    # Row 2 may only be one of tokens 60..69, so its probabilities over them sum to 1.
    hidden, weight, _, _, bitmask = _inputs(masked=True)
    index = torch.tensor([-1, -1, 2, -1, -1, -1])
    with torch.no_grad():
        rows = [
            chunked_token_logprobs(hidden, weight, torch.full((N,), t), allowed_index=index, allowed_bitmask=bitmask)
            for t in range(60, 70)
        ]
    total = sum(row[2].exp() for row in rows)
    assert float(total) == pytest.approx(1.0, abs=1e-12)


def test_backward_keeps_one_hidden_sized_vector_per_row_not_logits() -> None:
    hidden, weight, y, index, bitmask = _inputs(masked=True)
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_token_logprobs(hidden, weight, y, chunk_size=2, allowed_index=index, allowed_bitmask=bitmask)
    assert saved == [(N, H)]


def test_a_trainable_weight_is_fine_where_no_gradient_flows() -> None:
    hidden, weight, y, _, _ = _inputs(masked=False)
    with torch.no_grad():
        got = chunked_token_logprobs(hidden, weight.requires_grad_(), y)
    torch.testing.assert_close(got, _reference(hidden.detach(), weight.detach(), y), rtol=0, atol=1e-12)


def test_an_all_unconstrained_index_with_no_masks_is_the_plain_path() -> None:
    hidden, weight, y, _, _ = _inputs(masked=False)
    empty = torch.zeros((0, (V + 31) // 32), dtype=torch.int32)
    got = chunked_token_logprobs(hidden, weight, y, allowed_index=torch.full((N,), -1), allowed_bitmask=empty)
    torch.testing.assert_close(got, _reference(hidden, weight, y), rtol=0, atol=1e-12)


def test_no_grad_gives_the_same_values_without_a_graph() -> None:
    hidden, weight, y, index, bitmask = _inputs(masked=True)
    with torch.no_grad():
        got = chunked_token_logprobs(hidden, weight, y, chunk_size=4, allowed_index=index, allowed_bitmask=bitmask)
    assert not got.requires_grad
    torch.testing.assert_close(got, _reference(hidden.detach(), weight, y, index), rtol=0, atol=1e-12)


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
def test_bf16_weight_is_upcast_to_float32(hidden_dtype: torch.dtype) -> None:
    hidden64, weight64, y, index, bitmask = _inputs(masked=True)
    hidden = hidden64.detach().to(hidden_dtype).requires_grad_()
    weight = weight64.to(torch.bfloat16)
    got = chunked_token_logprobs(hidden, weight, y, chunk_size=4, allowed_index=index, allowed_bitmask=bitmask)
    assert got.dtype == torch.float32
    # The reference: the same bf16-rounded numbers, in float64.
    exact_hidden = hidden.detach().double().requires_grad_()
    expected = _reference(exact_hidden, weight.double(), y, index)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-4)
    (grad,) = torch.autograd.grad(got.sum(), hidden)
    (expected_grad,) = torch.autograd.grad(expected.sum(), exact_hidden)
    assert grad.dtype == hidden_dtype
    atol = 1e-4 if hidden_dtype == torch.float32 else 5e-2  # the gradient is rounded to bf16 at the end
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-2, atol=atol)


def _bad_calls() -> list[tuple[str, dict, str]]:
    hidden, weight, y, index, bitmask = _inputs(masked=True)
    ok = {"hidden": hidden, "weight": weight, "token_ids": y}
    disallowed = y.clone()
    disallowed[4] = 5  # row 4 is under ALLOWED[1], which does not have 5
    return [
        ("hidden 1-d", {**ok, "hidden": hidden[0]}, "hidden must be an"),
        ("hidden int", {**ok, "hidden": hidden.detach().long()}, "hidden must be an"),
        ("weight width", {**ok, "weight": weight[:, :3]}, "weight must be a"),
        ("weight trained", {**ok, "weight": weight.clone().requires_grad_()}, "training the output layer"),
        ("tokens int32", {**ok, "token_ids": y.int()}, "token_ids must be a long"),
        ("tokens short", {**ok, "token_ids": y[:3]}, "token_ids must be a long"),
        ("token >= V", {**ok, "token_ids": y.clone().fill_(V)}, r"token_ids must be in \[0, 70\)"),
        ("chunk 0", {**ok, "chunk_size": 0}, "chunk_size must be"),
        ("index alone", {**ok, "allowed_index": index}, "go together"),
        ("bitmask width", {**ok, "allowed_index": index, "allowed_bitmask": bitmask[:, :2]}, r"\(M, 3\) int32"),
        ("bitmask int64", {**ok, "allowed_index": index, "allowed_bitmask": bitmask.long()}, r"\(M, 3\) int32"),
        ("index past M", {**ok, "allowed_index": index.clone().fill_(3), "allowed_bitmask": bitmask}, "a row of"),
        ("index < -1", {**ok, "allowed_index": index.clone().fill_(-2), "allowed_bitmask": bitmask}, "a row of"),
        (
            "token disallowed",
            {**ok, "token_ids": disallowed, "allowed_index": index, "allowed_bitmask": bitmask},
            "row 4: token 5 is not allowed by its grammar mask",
        ),
    ]


@pytest.mark.parametrize(("kwargs", "message"), [c[1:] for c in _bad_calls()], ids=[c[0] for c in _bad_calls()])
def test_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        chunked_token_logprobs(**kwargs)


# -----------------------------------------------------------------------------
# a real (tiny) Qwen2 with LoRA


def _tiny_peft_model(target_modules: tuple[str, ...] = ("q_proj", "v_proj", "down_proj")):  # -> PeftModel
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(config).to(torch.float64)
    # init_lora_weights=False: random A and B, so the adapter changes the outputs from the first step.
    return get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), init_lora_weights=False)
    )


def _packed_batch():
    """Five sequences packed into rows of 16 (block-diagonal mask, restarting positions), two under a grammar."""
    rng = random.Random(0)
    sequences = []
    for i, n in enumerate([9, 7, 12, 4, 5]):
        tokens = [rng.randrange(V) for _ in range(n)]
        grammar: dict = {}
        if i in (1, 2):  # the last two sampled tokens under ALLOWED[i - 1] (the token itself made allowed)
            tokens[-2:] = [sorted(ALLOWED[i - 1])[0], sorted(ALLOWED[i - 1])[-1]]
            grammar = {"grammar_positions": (n - 2, n - 1), "grammar_bitmask": _pack([ALLOWED[i - 1]] * 2, V)}
        sampled = [0] * (n // 2) + [1] * (n - n // 2)
        sequences.append(TrainSequence(tokens, sampled, [-1.0] * n, trajectory=i, **grammar))
    return pack_sequences(sequences, max_tokens_per_row=16, pad_id=0)


def _full_logits_reference(model, batch) -> Tensor:
    """log_softmax of model(...).logits at the labels, a grammar row's over its mask (unpacked in Python)."""
    logits = model(
        input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
    ).logits
    words = batch.allowed_bitmask.tolist()
    allowed = torch.ones_like(logits, dtype=torch.bool)
    for (b, t), m in zip(
        batch.loss_mask.nonzero().tolist(), batch.allowed_index[batch.loss_mask].tolist(), strict=True
    ):
        if m >= 0:
            allowed[b, t] = torch.tensor([(words[m][v // 32] >> (v % 32)) & 1 == 1 for v in range(V)])
    logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return logp.gather(-1, batch.labels[..., None])[..., 0].where(batch.loss_mask, 0.0)


def _ours(model, batch, chunk_size: int = 5) -> Tensor:
    return policy_token_logprobs(
        model,
        batch.input_ids,
        batch.position_ids,
        batch.attention_mask,
        batch.labels,
        batch.loss_mask,
        chunk_size=chunk_size,
        allowed_index=batch.allowed_index,
        allowed_bitmask=batch.allowed_bitmask,
    )


def test_policy_token_logprobs_equals_the_models_logits_with_lora_gradients() -> None:
    model = _tiny_peft_model()
    batch = _packed_batch()
    assert batch.input_ids.shape[0] > 1 and (batch.allowed_index >= 0).sum() == 4
    lora = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in name for name in lora)

    got = _ours(model, batch)
    expected = _full_logits_reference(model, batch)
    assert got.shape == batch.labels.shape and bool((got[~batch.loss_mask] == 0).all())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    upstream = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = torch.autograd.grad((got * upstream).sum(), list(lora.values()))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), list(lora.values()))
    for name, grad, expected_grad in zip(lora, grads, expected_grads, strict=True):
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12, msg=name)

    with torch.no_grad(), model.disable_adapter():  # the reference policy: the base model
        base = _ours(model, batch)
        torch.testing.assert_close(base, _full_logits_reference(model, batch), rtol=0, atol=1e-12)
    assert (base - got.detach()).abs().max() > 1e-3  # the adapter mattered, and disabling it took effect


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # the LoRA on lm_head
def test_policy_token_logprobs_refuses_logits_that_are_not_hidden_at_weight() -> None:
    batch = _packed_batch()
    model = _tiny_peft_model()
    model.get_base_model().config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30\.0"):
        _ours(model, batch)

    model = _tiny_peft_model()
    base = model.get_base_model()
    base.lm_head = torch.nn.Linear(16, V, bias=True, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"plain nn\.Linear without bias"):
        _ours(model, batch)

    model = _tiny_peft_model(("q_proj", "lm_head"))  # a LoRA on the output layer
    with pytest.raises(ValueError, match=r"plain nn\.Linear without bias"):
        _ours(model, batch)

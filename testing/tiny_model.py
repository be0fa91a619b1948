"""A tiny real model, built locally in seconds: for tests and the learning example on a CPU.

No hub, no download: a byte-level BPE tokenizer trained with ``tokenizers`` on generated
arithmetic text (``<pad>``, ``<bos>``, ``<eos>``, a chat template), wrapped as
``PreTrainedTokenizerFast``, and a randomly initialised ``LlamaForCausalLM`` (2 layers, hidden
128, 4 heads of 32: the smallest head size vLLM's CPU attention kernel takes; ~430k parameters,
fp32), saved with ``save_pretrained`` so vLLM can serve the folder and reload weights from it.

The task (:func:`addition_prompts`): ``"A+B="`` answered ``"C"`` then ``<eos>``, exact reward.
Needs the ``transformers`` extra plus ``torch`` and ``tokenizers`` (in the vLLM venv built by
``scripts/vllm-env``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
)
"""Chat messages render as ``<bos>`` + their contents (the task's prompts are one user turn)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny model; the defaults are what the tests and the example use."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    max_positions: int = 512
    seed: int = 0


def addition_prompts(count: int, *, max_operand: int = 99, seed: int = 0) -> list[dict[str, str]]:
    """``count`` records ``{"prompt": "A+B=", "label": "C"}`` with ``0 <= A, B <= max_operand``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append({"prompt": f"{a}+{b}=", "label": str(a + b)})
    return out


def _corpus(seed: int) -> list[str]:
    """Text the BPE is trained on: the task's strings, so numbers split into few tokens."""
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{a}{op}{b}={value}")
    lines += [str(i) for i in range(1000)]
    return lines


def build_tokenizer(out: Path, spec: TinyModelSpec = TinyModelSpec()) -> Any:
    """Train and save the tokenizer into ``out``; returns the ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(str(out))
    return fast


def build_model(out: Path, spec: TinyModelSpec = TinyModelSpec(), *, tokenizer: Any = None) -> Path:
    """Build the tokenizer and a randomly initialised fp32 Llama into ``out`` (created); ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(out, spec)
    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return _save_new(LlamaForCausalLM(config).to(torch.float32), tok, out, {"spec": spec.__dict__})


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of the tiny mixture-of-experts model (Qwen3-MoE): every layer routes each token to
    ``topk`` of ``experts`` experts, so a routing replay has ``layers x topk`` ids per token."""

    vocab_size: int = 512
    hidden_size: int = 128
    moe_intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    experts: int = 8
    topk: int = 2
    max_positions: int = 512
    seed: int = 0


def build_moe_model(out: Path, spec: TinyMoeSpec = TinyMoeSpec(), *, tokenizer: Any = None) -> Path:
    """The tokenizer and a randomly initialised fp32 ``Qwen3MoeForCausalLM`` (``spec``) in ``out``:
    the model the routing-replay (R3) test serves on vLLM with ``--enable-return-routed-experts``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer(out, TinyModelSpec(vocab_size=spec.vocab_size))
    torch.manual_seed(spec.seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        num_experts=spec.experts,
        num_experts_per_tok=spec.topk,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return _save_new(Qwen3MoeForCausalLM(config).to(torch.float32), tok, out, {"moe_spec": spec.__dict__})


def _save_new(model: Any, tok: Any, out: Path, meta: dict[str, Any]) -> Path:
    """Save a freshly initialised model with the tokenizer's special ids and what built it."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "rollstream_tiny.json").write_text(json.dumps(meta))
    return out


def save_weights(model: Any, out: Path) -> Path:
    """Write a trained model's weights (and config) into ``out`` for an engine's reload."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def exact_reward(sample: Any, prompt: Any, label: Any) -> float:
    """1.0 when the response is exactly the label (the sum), else 0.0: the task's reward
    (``--reward rollstream.testing.tiny_model:exact_reward``)."""
    return 1.0 if sample.response.strip() == str(label) else 0.0

"""Offline checkpoints: random-weight Llama-family models with a byte-level BPE tokenizer.

    python -m engine.model.tiny_model --size tiny|small --out DIR [--arch llama|qwen2|qwen3|...]

writes an ordinary HF checkpoint directory (config.json, model.safetensors, tokenizer files with
a chat template, generation_config.json) that loads through `from_pretrained` like any real
model. Weights and tokenizer are the same for the same arguments.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
# Qwen's shape: tools listed in the system turn, an assistant's calls as <tool_call> blocks,
# tool results as <tool_response> in a user turn; without tools, every message as it is.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOL_CALL_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CHAT_TEMPLATE = (
    "{% set system_first = messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if system_first %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ " + repr(TOOLS_PREAMBLE) + " }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ " + repr(TOOL_CALL_FORMAT) + " + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and system_first and loop.first %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    init_std: float


SIZES = {
    # ~0.7M parameters: fast enough for the oracle tests to run many mixes.
    "tiny": ModelSize(64, 4, 4, 2, 176, 4096, 2048, 0.1),
    # Head size 64, the smallest FlashInfer's kernels take: CUDA backend tests.
    "tiny-hd64": ModelSize(128, 2, 2, 1, 256, 4096, 2048, 0.1),
    # Heads, KV heads and MLP columns that 2 and 4 tensor-parallel ranks divide.
    "tiny-wide": ModelSize(128, 2, 8, 4, 256, 4096, 2048, 0.1),
    # Rows and columns that 128x128 FP8 blocks and INT4 groups of 128 tile, also split over 2
    # tensor-parallel ranks: the quantized-checkpoint tests.
    "tiny-quant": ModelSize(256, 2, 4, 4, 512, 4096, 2048, 0.05),
    # ~100.7M parameters: the standard benchmark model (see ../shared/DESIGN.md).
    "small": ModelSize(768, 12, 12, 4, 2048, 16384, 4096, 0.05),
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# gpt-oss's released RoPE: YaRN over an original context of 4096.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

# name: (config class, model class, config overrides)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # A window far shorter than the test prompts, so that it changes the tokens.
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),
    # Tied embeddings, as in small Qwen2 checkpoints: no lm_head.weight in the file.
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": False, "tie_word_embeddings": True},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    # Mixtures of experts: 8 experts, 2 per token (a tiny model's MLP width each).
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    # Layer 1 dense (mlp_only_layers); top-k weights renormalized.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "use_sliding_window": False,
        },
    ),
    # Every other layer sparse (decoder_sparse_step 2), a gated shared expert, the softmax's
    # own top-k weights.
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 96,
            "shared_expert_intermediate_size": 128,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
            "use_sliding_window": False,
        },
    ),
    # Attention sinks; windowed layers (a window shorter than the test prompts) alternating
    # with full ones; YaRN rope; a biased router over 8 experts, 2 per token, biased clamped
    # SwiGLU experts.
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 12,
            "rope_parameters": GPT_OSS_ROPE | {"original_max_position_embeddings": 64},
        },
    ),
}

_SYLLABLES = [
    "ka",
    "ri",
    "to",
    "na",
    "shi",
    "mo",
    "be",
    "lu",
    "ze",
    "pa",
    "qua",
    "vor",
    "tin",
    "ex",
    "ul",
    "im",
    "ra",
    "so",
    "del",
    "fen",
    "gar",
    "hup",
    "ist",
    "jor",
    "ack",
    "ble",
    "cro",
    "dwi",
    "eth",
    "fli",
    "gno",
    "hy",
    "ion",
    "jax",
    "kel",
    "lom",
    "mun",
    "nix",
    "oth",
    "pre",
    "quo",
    "rus",
    "sta",
    "tre",
    "una",
    "vel",
    "wyn",
    "xor",
    "yst",
    "zun",
    "the",
    "and",
    "ing",
    "ion",
    "ent",
]
_TEXT = (
    "The quick brown fox jumps over the lazy dog. Serving many requests at once needs a "
    "scheduler that looks at every step. Café, naïve, façade, jalapeño, Zürich, Ångström. "
    "日本語のテキスト、中文文本、한국어 텍스트. Emoji: 🚀🔥✨🙂. Numbers 0123456789, "
    "symbols {}[]()<>!?;:'\"@#$%^&*_-+=/\\|~`. def step(self): return self.schedule()\n"
)


def _corpus(seed: int, num_words: int = 120_000) -> list[str]:
    """Deterministic training text: real sentences plus random syllable words."""
    rng = random.Random(seed)
    lines = [_TEXT] * 50
    words = []
    for _ in range(num_words):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
        words.append(word.capitalize() if rng.random() < 0.1 else word)
    lines += [" ".join(words[i : i + 16]) for i in range(0, len(words), 16)]
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer reached {tok.get_vocab_size()} of {vocab_size} tokens")
    return _wrapped(tok)


def padded_tokenizer(vocab_size: int, trained: int = 16384, seed: int = 0):
    """The tiny models' tokenizer (`trained` BPE tokens) grown to `vocab_size` ids for a
    checkpoint with a real model's vocabulary: ids past the trained ones are tokens no merge
    produces (prompts never hold them) that decode to " t<id>" (what a random model says)."""
    from tokenizers import Tokenizer

    tok = build_tokenizer(trained, seed)._tokenizer
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(trained, vocab_size):
        vocab[f"\u0120t{i}"] = i  # "Ġ": the byte-level alphabet's space
    return _wrapped(Tokenizer.from_str(json.dumps(data)))


def _wrapped(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def build_model(
    size: str,
    arch: str,
    seed: int,
    eos_token_id: int,
    pad_token_id: int,
    overrides: dict | None = None,
):
    import torch
    import transformers

    spec = SIZES[size]
    config_cls_name, model_cls_name, extra = ARCHS[arch]
    extra = {"tie_word_embeddings": False, **extra, **(overrides or {})}
    if arch.startswith(("qwen3", "gpt-oss")):
        extra["head_dim"] = spec.hidden_size // spec.num_attention_heads
    config = getattr(transformers, config_cls_name)(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        **extra,
    )
    config.architectures = [model_cls_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                # Norm gains near 1 but not exactly, so a wrong norm shows in the oracle.
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("_bias") or name.endswith(".sinks"):
                # gpt-oss's expert biases; sinks of a logit's size, so that they matter.
                scale = 1.0 if name.endswith(".sinks") else 0.1
                param.copy_(scale * torch.randn(param.shape, generator=gen))
            else:
                # Larger than HF's 0.02 so that logits spread out and argmax ties are rare.
                param.copy_(spec.init_std * torch.randn(param.shape, generator=gen))
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.bos_token_id = None
    return model


def make_model(
    out: str | Path,
    size: str = "tiny",
    arch: str = "llama",
    seed: int = 0,
    overrides: dict | None = None,
) -> Path:
    """Write the checkpoint directory (skipped if it already holds one) and return its path;
    `overrides`: config fields set beyond the size's and the architecture's."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(SIZES[size].vocab_size, seed)
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(size, arch, seed, eos, pad, overrides)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    path = make_model(args.out, args.size, args.arch, args.seed)
    print(f"wrote {args.size} {args.arch} checkpoint to {path}")


if __name__ == "__main__":
    main()

"""Build a tiny random-weight Llama model and a locally trained tokenizer.

Used by the pdgate real-engine e2e test (tests/e2e/vllm_cpu.sh) so that vLLM
can run on CPU with nothing downloaded from a model hub. Deterministic: the same
seed gives the same weights and tokenizer, so outputs are comparable across runs.

Usage: python make_tiny_model.py OUT_DIR [--size tiny|bench]

``tiny`` (default) is the e2e model. ``bench`` is a bigger random Llama (hidden
768, 6 layers, ~37M parameters) whose prefill is slow enough on CPU for prefix
cache hits to show in TTFT (bench/cache.sh); same tokenizer, same seed.
"""

import json
import random
import sys
from pathlib import Path

# Shapes chosen for vLLM's CPU attention backend: head_dim must be one of the
# supported sizes (32 and 64 work), and num_heads must be a multiple of num_kv_heads.
SIZES = {
    "tiny": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "intermediate": 256,
        "max_pos": 512,
    },
    # ~37.5M parameters; KV per token in float32 = 2 * 6 * 4 * 64 * 4 B = 12 KiB.
    "bench": {
        "hidden": 768,
        "layers": 6,
        "heads": 12,
        "kv_heads": 4,
        "head_dim": 64,
        "intermediate": 1920,
        "max_pos": 4096,
    },
}
VOCAB = 1024
SEED = 1234

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]

# A minimal chat template: vLLM's chat endpoint refuses tokenizers without one.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{% elif m['role'] == 'user' %}<|user|>"
    "{% else %}<|assistant|>{% endif %}{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus(n_lines: int) -> list[str]:
    rng = random.Random(SEED)
    words = (  # noqa: SIM905 (one readable line of vocabulary)
        "the prefill decode engine cache block token request gateway transfer "
        "memory host port model stream chat completion answer question small "
        "fast slow river mountain tree city light water fire earth number one two "
        "three four five six seven eight nine ten hello world pdgate kv"
    ).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) for _ in range(n_lines)]


def build_tokenizer(out: Path, max_pos: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=SPECIALS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = max_pos
    fast.save_pretrained(out)
    return len(fast)


def build_model(out: Path, vocab: int, shape: dict) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["max_pos"],
        # Wider than the default 0.02 so greedy decoding has clear winners
        # (near-ties could flip between code paths and make comparisons flaky).
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    args = sys.argv[1:]
    size = "tiny"
    if len(args) == 3 and args[1] == "--size" and args[2] in SIZES:
        size = args[2]
        args = args[:1]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    shape = SIZES[size]
    out = Path(args[0])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, shape["max_pos"])
    params = build_model(out, vocab, shape)
    stamp = {"seed": SEED, "hidden": shape["hidden"], "layers": shape["layers"], "vocab": vocab}
    if size != "tiny":  # the tiny stamp stays byte-identical so cached tiny models are reused
        stamp.update(size=size, params=params)
    (out / "pdgate-tiny-model.json").write_text(json.dumps(stamp) + "\n")
    print(f"{size} model written to {out} (vocab {vocab}, {params} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

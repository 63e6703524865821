"""Tokenizer files for the stand-in's model directory, built here (the `tokenizers` library, nothing
downloaded): a small byte-level BPE with one chat family's special tokens and a Jinja chat template in
that family's format, saved as tokenizer.json + tokenizer_config.json as a Hugging Face model ships them.

Families (SpecForge template names): `llama3`, `qwen`, `deepseek-v3`, `kimi-k2-thinking` — four
different ways of marking turns, and two of SpecForge's parser types (general, thinking). The llama3
template refuses roles that do not alternate (as Llama-2 / Mistral templates do), so the tests can show
a template's refusal. Every id is below VOCAB_LIMIT, so the stand-in's tiny model (vocab 512) takes them.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_LIMIT = 512
CORPUS = [
    "hello world, how are you today? I am fine, thank you.",
    "the quick brown fox jumps over the lazy dog while the cat sleeps",
    "You are a helpful assistant. Answer briefly and precisely.",
    "what is the capital of France? Paris is the capital of France.",
    "def add(a, b): return a + b  # numbers 0 1 2 3 4 5 6 7 8 9",
    "user assistant system tool think reasoning answer question",
]

_ALTERNATE = ("{% for m in messages %}{% if m.role != 'system' %}{% set ns.i = ns.i + 1 %}"
              "{% if (m.role == 'user') != (ns.i % 2 == 1) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}{% endif %}{% endfor %}")

FAMILIES = {
    "llama3": {
        "bos": "<|begin_of_text|>", "eos": "<|eot_id|>",
        "specials": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "template": "{% set ns = namespace(i=0) %}" + _ALTERNATE + "{{ bos_token }}{% for m in messages %}"
                    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    },
    "qwen": {
        "bos": None, "eos": "<|im_end|>",
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    },
    "deepseek-v3": {
        "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>",
        "specials": ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        "template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}"
                    "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
                    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
                    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    },
    "kimi-k2-thinking": {
        "bos": None, "eos": "<|im_end|>",
        "specials": ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
                     "<think>", "</think>"],
        "template": "{% for m in messages %}{% if m.role == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
                    "<think>{{ m.reasoning_content or '' }}</think>{{ m.content }}<|im_end|>"
                    "{% elif m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
                    "{% else %}<|im_system|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
    },
}


def write_tokenizer(path, family: str = "llama3", vocab_size: int = 400) -> Path:
    """Write tokenizer.json and tokenizer_config.json for `family` into `path` (created); same input, same bytes.
    Into a stand-in model directory with weights, the weights are written again with the lm head mapped onto this
    tokenizer's ordinary tokens (weights.mapped_head), as a model's head is trained on its tokenizer's text."""
    from patchctl.simserver.weights import INDEX_FILE, write_weights  # noqa: PLC0415
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    fam = FAMILIES[family]
    if vocab_size > VOCAB_LIMIT:
        raise ValueError(f"vocab_size {vocab_size} > {VOCAB_LIMIT}: the stand-in's model could not take every id")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=fam["specials"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": fam["bos"], "eos_token": fam["eos"],
           "model_max_length": 131072, "chat_template": fam["template"], "clean_up_tokenization_spaces": False}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    model_cfg = d / "config.json"
    if model_cfg.is_file() and (d / INDEX_FILE).is_file():  # a model directory: its head speaks this tokenizer
        mc = json.loads(model_cfg.read_text())
        write_weights(d, mc["num_hidden_layers"], mc["hidden_size"], mc["vocab_size"])
    return d

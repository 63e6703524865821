"""The stand-in's tokenizer and chat template, as SGLang's TokenizerManager and OpenAI chat endpoint use
the model directory's: tokenizer.json for ids, tokenizer_config.json's `chat_template` rendered the way
transformers' `apply_chat_template` renders it (sandboxed Jinja, trim_blocks, lstrip_blocks,
`raise_exception`, the special tokens as variables), the eos token ending generation.

Without tokenizer files in the model directory the stand-in keeps its byte tokenizer and has no chat
endpoint (as a server without a chat template refuses one).

Generation with a tokenizer (`Chooser`): the tiny model's tokens do not mix, so its greedy token depends
on the last token only, and every generation prompt ends with the same tokens (the template's assistant
header). So the FIRST token of an answer is chosen from a checksum of the whole prompt (mapped onto the
tokenizer's ordinary tokens: whole words that re-tokenize to themselves, `ordinary_tokens`), and an answer
depends on its conversation; every later token is the model's greedy token (its lm head maps onto the
ordinary tokens: `weights.mapped_head`, written with the tokenizer), so the answer goes on as the model's
logits say and a drafter trained on the model's hidden states can predict it. The eos ends an answer now and
then (a checksum of the context, about one token in 23). Deterministic.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path


class ChatTokenizer:
    def __init__(self, model_dir):
        from tokenizers import Tokenizer  # noqa: PLC0415 (only when the model directory has a tokenizer)

        d = Path(model_dir)
        self.tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        self.cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        jinja = d / "chat_template.jinja"
        self.template_text = jinja.read_text() if jinja.is_file() else self.cfg.get("chat_template")
        self.specials = {k: _content(self.cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        eos = self.specials.get("eos_token")
        self.eos_ids = [self.tok.token_to_id(eos)] if eos and self.tok.token_to_id(eos) is not None else []
        self._template = None

    @classmethod
    def of(cls, model_dir):
        return cls(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        """skip_special_tokens, as SGLang's detokenizer does by default."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def render(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        if not self.template_text:
            raise ValueError("this model's tokenizer has no chat template")
        if self._template is None:
            from jinja2.ext import loopcontrols  # noqa: PLC0415
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

            def raise_exception(message):
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.template_text)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **{k: v for k, v in self.specials.items() if v is not None})


class Chooser:
    """(work, greedy token) -> the token generated; see the module docstring."""

    EOS_EVERY = 23  # about one token in 23 ends the answer (variable lengths, finish_reason stop)

    def __init__(self, tok: ChatTokenizer, vocab: int):
        self.ordinary = ordinary_tokens(tok, vocab)
        self.is_ordinary = frozenset(self.ordinary)
        self.eos = tok.eos_ids[0] if tok.eos_ids else None

    def __call__(self, work, greedy: int) -> int:
        ctx = zlib.crc32(",".join(map(str, list(work.input_ids) + work.output_ids)).encode())
        mix = (ctx * 1000003 + greedy) & 0xFFFFFFFF
        if not work.output_ids:
            return self.ordinary[mix % len(self.ordinary)]
        if self.eos is not None and mix % self.EOS_EVERY == 0:
            return self.eos
        # a model directory whose head was written before its tokenizer (tied): still printable text
        return greedy if greedy in self.is_ordinary else self.ordinary[greedy % len(self.ordinary)]


def ordinary_tokens(tok: ChatTokenizer, vocab: int) -> list[int]:
    """The ids below `vocab` an answer is made of: whole words with their leading space (" the", " fox") that
    the tokenizer encodes back to the same id, so an answer's text re-tokenizes to exactly the served ids (the
    pre-tokenizer splits at the spaces), as a real model's text mostly does; a tokenizer without such words:
    every id that decodes to a printable piece of text (no special token)."""
    special = {t.content for t in tok.tok.get_added_tokens_decoder().values()} if hasattr(
        tok.tok, "get_added_tokens_decoder") else set()
    printable = [i for i in range(min(vocab, tok.tok.get_vocab_size()))
                 if tok.tok.id_to_token(i) not in special | {None}
                 and _printable(tok.tok.decode([i], skip_special_tokens=True))]
    words = [i for i in printable if re.fullmatch(r" [A-Za-z]+", tok.decode([i]))
             and tok.encode(tok.decode([i]), add_special_tokens=False) == [i]]
    return words or printable


def _printable(text: str) -> bool:
    return bool(text.strip()) and "\ufffd" not in text and text.replace(" ", "").isprintable()


def _content(v):
    return v.get("content") if isinstance(v, dict) else v

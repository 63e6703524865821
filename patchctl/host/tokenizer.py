"""The served model's tokenizer files: which files they are, their digest, and their bytes for the controller.

`capture prepare --from HOST` tokenizes with exactly the files the server on HOST loaded, and
`capture run` refuses a dataset prepared with another tokenizer: both need the same list of files
and the same digest on the controller and on the host, so both live here (standard library only).

Only the files that decide token ids and the chat template are read, never weights:
tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json,
chat_template.jinja / chat_template.json, tokenizer.model (SentencePiece), *.tiktoken,
vocab.json / merges.txt / vocab.txt (slow tokenizers).

The digest is sha256 over `name NUL sha256(file) LF` for each such file, names sorted: two
directories with the same tokenizer files have the same digest, whatever else they hold.
"""

import base64
import hashlib
import http.client
import os

from .osutil import expand, sha256_file
from .server import http_request

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
SUFFIXES = (".tiktoken",)
MAX_FILE_BYTES = 64 << 20  # a tokenizer file is at most tens of MB; anything bigger is not one


def is_tokenizer_file(name):
    return name in FILES or name.endswith(SUFFIXES)


def digest(files):
    """The tokenizer's digest from {name: sha256 of the file}."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(("%s\0%s\n" % (name, files[name])).encode("utf-8"))
    return h.hexdigest()


def listing(path, with_data=False):
    """{"path", "files": {name: sha256}, "digest", "data"?: {name: base64}} of the tokenizer files directly in
    `path`; "digest" is None when there are none (a hub id, not a directory)."""
    path = expand(path)
    files, data = {}, {}
    try:
        names = sorted(os.listdir(path))
    except OSError:
        names = []
    for name in names:
        full = os.path.join(path, name)
        if not is_tokenizer_file(name) or not os.path.isfile(full) or os.path.getsize(full) > MAX_FILE_BYTES:
            continue
        if with_data:
            with open(full, "rb") as f:
                raw = f.read()
            files[name] = hashlib.sha256(raw).hexdigest()
            data[name] = base64.b64encode(raw).decode("ascii")
        else:
            files[name] = sha256_file(full)
    out = {"path": path, "files": files, "digest": digest(files) if files else None}
    if with_data:
        out["data"] = data
    return out


def served(cfg, with_data=False):
    """The tokenizer files of the model the server of `cfg` serves (its tokenizer path, else its model path,
    from /get_model_info), with "model_path" and "tokenizer_path"; {"digest": None, "why"} when unknown."""
    try:
        status, info = http_request(cfg["host"], cfg["port"], "GET", "/get_model_info", None, 10)
    except (OSError, http.client.HTTPException) as e:
        return {"digest": None, "files": {}, "why": "the server on port %s does not answer: %s" % (cfg.get("port"), e)}
    if status != 200 or not isinstance(info, dict):
        return {"digest": None, "files": {}, "why": "/get_model_info answered HTTP %s" % status}
    model_path = info.get("model_path") or ""
    tok_path = info.get("tokenizer_path") or model_path
    out = listing(tok_path, with_data) if tok_path else {"path": "", "files": {}, "digest": None}
    out.update(model_path=model_path, tokenizer_path=tok_path)
    if out["digest"] is None:
        out["why"] = "no tokenizer files in %s (the served model's tokenizer path)" % (tok_path or "''")
    return out


def special_ids(path):
    """{"bos_token_id", "eos_token_id", "pad_token_id", "mask_token_id", "unk_token_id", "tokenizer_size"} of the
    tokenizer files in `path`: each special token tokenizer_config.json names (a string or {"content": ...}),
    looked up in tokenizer.json's added tokens, then its vocabulary; a token not named or not found is left out.
    tokenizer_size: the distinct ids of the vocabulary and the added tokens (`len(tokenizer)`). A draft model's
    config carries these ids (SpecForge's draft embeds with padding_idx = pad_token_id; a DFlash/DSpark draft's
    mask token is the tokenizer's, else an unused slot, else pad/eos/unk: training/model_utils.py
    resolve_mask_token_id), so they must be the served tokenizer's."""
    import json

    path = expand(path or "")
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            conf = json.load(f)
        with open(os.path.join(path, "tokenizer.json")) as f:
            tok = json.load(f)
    except (OSError, ValueError):
        return {}
    ids = dict((t.get("content"), t.get("id")) for t in tok.get("added_tokens") or [] if isinstance(t, dict))
    vocab = (tok.get("model") or {}).get("vocab")
    out = {}
    # BPE/WordPiece: {token: id}; Unigram: [[piece, score], ...] (ids are the positions)
    seen = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab))) if isinstance(vocab, list) else set()
    seen.update(i for i in ids.values() if isinstance(i, int))
    if seen:
        out = {"tokenizer_size": len(seen)}
    for key in ("bos", "eos", "pad", "mask", "unk"):
        name = conf.get(key + "_token")
        if isinstance(name, dict):
            name = name.get("content")
        if not isinstance(name, str):
            continue
        i = ids.get(name)
        if i is None and isinstance(vocab, dict):
            i = vocab.get(name)
        if isinstance(i, int):
            out[key + "_token_id"] = i
    return out

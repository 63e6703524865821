"""The longest prompt a server takes, as SGLang 0.5.23 decides it (standard library only).

SGLang aborts a request whose `len(input_ids) >= max_req_input_len` (`managers/scheduler.py:3245-3252`,
`managers/utils.py:validate_input_length`), where

    max_req_input_len = min(context_len - 1, kv_pool_tokens - 1) - 5      (`managers/tp_worker.py:568-572`)

and `GET /server_info` reports that number (`build_server_info` merges the scheduler's init info). An
aborted request still runs a 1-token stub prefill and answers HTTP 400. `context_len` is the server's
`--context-length`, else config.json's context by `get_context_length` (the first of CONTEXT_LENGTH_KEYS,
times a rope scaling factor). Without a running SGLang to ask, `config_context_len` applies that rule to
config.json; it returns None when no key is there, since SGLang would then read transformers' per-model
default, which this side cannot know. The stand-in (patchctl.simserver) uses the same functions.
"""

MARGIN = 5  # max_req_input_len = max_req_len - 5
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")  # sglang/srt/utils/hf_transformers/common.py:668
DEFAULT_CONTEXT_LEN = 2048  # get_context_length's answer when no key is set on the config object


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def text_config(c):
    """The part of config.json that describes the language model (SGLang's hf_text_config)."""
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        return c["text_config"]
    return c


def config_context_len(c):
    """(context length, "key=value" it came from) by SGLang's get_context_length, or (None, None)."""
    c = text_config(c)
    rope = c.get("rope_scaling")
    factor = 1
    if isinstance(rope, dict) and rope:
        factor = rope.get("factor", 1)
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        v = c.get(key)
        if v is not None:
            try:
                n = int(factor * v)
            except (TypeError, ValueError):
                return None, None
            src = "%s=%s" % (key, v) + (" x rope factor %s" % factor if factor != 1 else "")
            return (n, src) if n > 0 else (None, None)
    return None, None


def max_req_input_len(context_len, kv_tokens):
    """SGLang's bound: a prompt of this many tokens or more is aborted."""
    return min(context_len - 1, kv_tokens - 1) - MARGIN


def from_server_info(info):
    """{"max_req_input_len", "context_length", "max_total_num_tokens"} from a /server_info answer
    (None where it says nothing)."""
    info = info if isinstance(info, dict) else {}
    return {"max_req_input_len": _int(info.get("max_req_input_len")),
            "context_length": _int(info.get("context_length")),
            "max_total_num_tokens": _int(info.get("max_total_num_tokens"))}

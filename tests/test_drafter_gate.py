"""The canary's gate (commands/drafter/gate.py): each rule refuses what it must and names itself."""

from patchctl.commands.drafter.gate import Gate, accept_of, describe

OFF = {"accept_length": None, "tokens_per_s": 100.0}


def arm(acc, tps=100.0):
    return {"accept_length": acc, "tokens_per_s": tps}


def test_a_server_without_speculation_counts_as_one_token_per_forward():
    assert accept_of(OFF) == 1.0
    assert describe(OFF) == "no speculation (1.00), 100.0 tok/s"


def test_defaults_refuse_a_drafter_that_barely_accepts_against_no_speculation():
    assert Gate().verdict(OFF, arm(2.4)) == []
    missed = Gate().verdict(OFF, arm(1.1))
    assert missed == ["acceptance length 1.10 < --min-accept-length 1.5"]


def test_never_less_than_what_serves():
    missed = Gate().verdict(arm(3.0), arm(2.5))
    assert missed == ["acceptance length 2.50 < the baseline's 3.00"]
    assert Gate(min_gain=0.5).verdict(arm(3.0), arm(3.2)) == [
        "acceptance length 3.20 < the baseline's 3.00 + --min-gain 0.5"]
    assert Gate().verdict(arm(3.0), arm(3.0)) == []


def test_a_server_that_reports_no_speculation_after_the_deploy_fails():
    missed = Gate(min_accept_length=0).verdict(OFF, OFF)
    assert len(missed) == 1 and "not serving" in missed[0]


def test_tokens_per_second_loss_only_when_asked():
    assert Gate().verdict(arm(2.0, 100), arm(2.5, 50)) == []
    missed = Gate(max_tps_loss=0.1).verdict(arm(2.0, 100), arm(2.5, 85))
    assert missed == ["85.0 tok/s < 90.0 (the baseline's 100.0 less --max-tps-loss 10%)"]
    assert Gate(max_tps_loss=0.1).verdict(arm(2.0, 100), arm(2.5, 95)) == []


# --- per category, loops, lengths (commands/drafter/canary.py, host/accept.py loop_of) -----------------------------------

from patchctl.commands.drafter import canary  # noqa: E402
from patchctl.host.accept import loop_of, per_request  # noqa: E402


def test_a_loop_is_a_short_block_repeated_over_the_last_32_tokens_or_more():
    assert loop_of([5] * 32) == {"period": 1, "tokens": 32, "start": 0}
    assert loop_of([5] * 31) is None  # too short to judge
    assert loop_of(list(range(100, 110)) + [1, 2] * 16) == {"period": 2, "tokens": 32, "start": 10}
    assert loop_of(list(range(100, 140)) + [1, 2] * 15) is None  # 30 looping tokens: under 32
    sixteen = list(range(16))
    assert loop_of([99] + sixteen * 2) == {"period": 16, "tokens": 32, "start": 1}
    assert loop_of(list(range(17)) * 3) is None  # period 17: longer than a short block
    assert loop_of(list(range(64))) is None  # no repetition at all
    # chat-like text with a repeated word now and then is not a loop
    assert loop_of([3, 9, 4, 9, 5, 9, 6, 7] * 2 + list(range(20, 40))) is None


def rows(*spec):
    """(completion_tokens, verify_ct, looping) -> per-request rows as accept.per_request makes them."""
    out = []
    for c, v, looping in spec:
        ids = [7] * c if looping else list(range(c))
        out += per_request([({"prompt_tokens": 12, "completion_tokens": c, "spec_verify_ct": v}, ids)])
    return out


def test_each_category_is_counted_as_the_whole_set_is():
    r = rows((60, 20, False), (60, 30, False), (60, 60, False))
    cats = canary.by_category(r, ["chat", "chat", "code"])
    assert cats == {"chat": {"requests": 2, "completion_tokens": 120, "verify_ct": 50, "accept_length": 2.4},
                    "code": {"requests": 1, "completion_tokens": 60, "verify_ct": 60, "accept_length": 1.0}}
    assert canary.by_category(r, [None] * 3) == {}


def measured(r, cats, **kw):
    return canary.summarize({"accept_length": 2.0, "tokens_per_s": 100.0, "per_request": r}, cats,
                            list(range(1, len(r) + 1)), **kw)


def test_a_category_below_its_baseline_fails_though_the_whole_set_gains():
    base = measured(rows((60, 30, False), (60, 30, False)), ["chat", "code"])
    new = measured(rows((60, 15, False), (60, 40, False)), ["chat", "code"])  # chat 4.0, code 1.5
    new["accept_length"] = 120 / 55
    assert Gate().verdict(base, new) == ["category code: acceptance length 1.50 < the baseline's 2.00 (1 prompts)"]
    assert Gate(min_category_gain=-0.5).verdict(base, new) == []  # relaxed by the flag


def test_a_canary_whose_gain_is_mostly_loops_fails_and_names_them():
    # a looping completion accepts 4 a step, chat 1.5: the average says 2.9 and hides the chat figure
    new = measured(rows((64, 16, True), (64, 16, True), (60, 40, False)), [None] * 3)
    lp = new["loops"]
    assert lp["requests"] == 2 and lp["lines"] == [1, 2] and lp["periods"] == [1]
    assert lp["gain_share"] == round(96 / 116, 4) and lp["accept_length_without"] == 1.5
    missed = Gate(min_accept_length=0).verdict(arm(1.0), new)
    assert len(missed) == 1 and "2 of 3 completions degenerate into a loop (period 1; prompts at lines 1, 2)" in missed[0]
    assert "83% of the speculative gain" in missed[0] and "without them 1.50" in missed[0]
    # a few loops in a canary whose gain is mostly real: noted, not failed
    ok = measured(rows((64, 16, True), (60, 20, False), (60, 20, False)), [None] * 3)
    assert ok["loops"]["requests"] == 1 and Gate(min_accept_length=0).verdict(arm(1.0), ok) == []


def test_a_canary_without_long_prompts_says_so():
    r = rows((60, 20, False), (60, 20, False))
    ln = canary.lengths(r, context_length=4096, train_length=2048)
    assert (ln["min"], ln["median"], ln["max"], ln["long_from"], ln["long_prompts"]) == (12, 12.0, 12, 2048, 0)
    assert "covers none of the long lengths" in ln["long_gap"] and "2048 tokens the draft was trained on" in ln["long_gap"]
    assert "half the server's context length 4096" in canary.lengths(r, context_length=4096)["long_gap"]
    long = per_request([({"prompt_tokens": 3000, "completion_tokens": 5, "spec_verify_ct": 2}, [1, 2, 3])])
    assert canary.lengths(r + long, context_length=4096, train_length=2048)["long_gap"] is None
    assert canary.lengths(r)["long_gap"] is None  # nothing to compare with: nothing said


def test_a_prompt_set_carries_categories_and_refuses_a_bad_one(tmp_path):
    import json

    import pytest

    from patchctl.core.errors import BadInput
    from patchctl.commands.drafter.prompts import load_prompts

    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"input_ids": [1, 2], "category": "chat"}) + "\n\n"
                 + json.dumps({"text": "x"}) + "\n" + json.dumps({"input_ids": [3], "category": "code"}) + "\n")
    ps = load_prompts(p)
    assert ps.categories == ["chat", None, "code"] and ps.category_names == ["chat", "code"] and ps.lines == [1, 3, 4]
    p.write_text(json.dumps({"input_ids": [1], "category": ""}) + "\n" + json.dumps({"input_ids": [1], "category": 3}) + "\n")
    with pytest.raises(BadInput) as e:
        load_prompts(p)
    assert f"{p}:1: category ''" in str(e.value) and f"{p}:2: category 3" in str(e.value)

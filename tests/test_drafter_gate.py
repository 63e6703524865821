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

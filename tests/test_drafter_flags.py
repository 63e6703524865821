"""The speculative flags SGLang 0.5.23 accepts but that cannot work (host/drafter.py check_speculative,
launch_problems): every file and line a refusal names holds, in the real 0.5.23 tree, the code it says decides
it; and the attention-backend rules for MLA and MHA drafts refuse what they must and nothing else."""

from __future__ import annotations

import re

import pytest

from patchctl.host.drafter import DEFAULTS, DRAFT_BACKENDS, SG, check_speculative, launch_problems

# what each cited range must contain in sglang/srt/ of 0.5.23
CITED = {
    "eagle3_aux": "if spec_algorithm.is_eagle3():",
    "nextn_alias": 'return "EAGLE"',
    "steps_assert": "assert (",
    "topk1_tokens": "speculative_num_draft_tokens is adjusted to speculative_num_steps + 1",
    "tree_topk": "torch.topk(score_list, num_draft_token - 1",
    "trtllm_mha_topk": "trtllm_mha backend only supports topk = 1",
    "page_tree": '_PAGE_TREE_SPEC_BACKENDS = ("flashinfer", "fa3", "triton")',
    "draft_backend": "backend_type = self.draft_attn_backend or configured",
    "mla_only": "requires MLA model (use_mla_backend=True)",
    "mha_only": "TRTLLMHAAttnMultiStepDraftBackend",
}


def cited_text(tree, ref: str) -> str:
    """The lines a reference `path:a-b, c-d (...)` names, joined."""
    path, _, rest = ref.partition(":")
    lines = (tree / "sglang" / "srt" / path).read_text().splitlines()
    out = []
    for a, b in re.findall(r"(\d+)(?:-(\d+))?", rest.split(" (")[0]):
        out += lines[int(a) - 1:int(b or a)]
    return "\n".join(out)


@pytest.mark.parametrize("key", sorted(CITED))
def test_every_cited_line_of_sglang_holds_what_the_refusal_says(sglang_tree, key):
    assert CITED[key] in cited_text(sglang_tree, SG[key]), (key, SG[key])


def test_the_draft_backend_table_is_sglangs(sglang_tree):
    src = (sglang_tree / "sglang/srt/speculative/draft_utils.py").read_text()
    table = src[src.index("def create_decode_backend"):src.index("def _stamp_qsa")]
    assert set(re.findall(r'"([a-z_0-9]+)": self\._create_', table)) == set(DRAFT_BACKENDS)


def test_eagle3_dflash_and_dspark_are_the_algorithms_and_says_why():
    for algo in ("EAGLE", "NEXTN", "STANDALONE"):
        _, probs = check_speculative({"algorithm": algo})
        assert [k for k, _ in probs] == ["algorithm"] and "spec_aux_hidden_state.py:185" in probs[0][1]
    assert check_speculative({"algorithm": "EAGLE3"})[1] == []
    assert check_speculative({"algorithm": "DFLASH"})[1] == [] and check_speculative({"algorithm": "DSPARK"})[1] == []


def test_tree_sizes_follow_sglangs_candidate_count():
    # steps 2, top-k 4: 4 + 1 * 16 = 20 candidates, so 21 draft tokens fit (SGLang accepts), 22 do not
    assert check_speculative({"num_steps": 2, "eagle_topk": 4, "num_draft_tokens": 21})[1] == []
    probs = check_speculative({"num_steps": 2, "eagle_topk": 4, "num_draft_tokens": 22})[1]
    assert probs and "at most 21" in probs[0][1]
    assert check_speculative({"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8})[1] == []  # SGLang's Llama default


MLA, MHA = "Eagle3DeepseekV2ForCausalLM", "LlamaForCausalLMEagle3"


def spec(*args, topk=1):
    return dict(DEFAULTS, eagle_topk=topk, num_draft_tokens=4 if topk == 1 else 8, args=list(args))


def flags(problems):
    return [k for k, _ in problems]


def test_an_mla_draft_cannot_inherit_an_mha_only_backend():
    probs = launch_problems(spec(), ["--attention-backend", "trtllm_mha"], MLA)
    assert flags(probs) == ["--speculative-draft-attention-backend"] and "MLA draft" in probs[0][1]
    assert "inherits it" in probs[0][1]
    # its own backend given: nothing to refuse
    assert launch_problems(spec("--speculative-draft-attention-backend", "fa3"), ["--attention-backend", "trtllm_mha"],
                           MLA) == []
    # an MLA target backend the draft factory builds an MLA draft backend on: shared
    for b in ("flashmla", "trtllm_mla", "fa3", "flashinfer", "triton"):
        assert launch_problems(spec(), ["--attention-backend", b], MLA) == [], b


def test_an_mha_draft_cannot_inherit_an_mla_only_backend():
    for b in ("flashmla", "trtllm_mla", "cutedsl_mla"):
        probs = launch_problems(spec(), [f"--decode-attention-backend={b}"], MHA)
        assert flags(probs) == ["--speculative-draft-attention-backend"] and "MHA draft" in probs[0][1], b
    assert launch_problems(spec("--speculative-draft-attention-backend", "fa3"), ["--attention-backend", "flashmla"],
                           MHA) == []
    assert launch_problems(spec(), ["--attention-backend", "trtllm_mha"], MHA) == []


def test_tree_drafting_on_backends_sglang_refuses_it_on():
    probs = launch_problems(spec(topk=4), ["--attention-backend", "trtllm_mha"], MHA)
    assert "--attention-backend" in flags(probs)
    probs = launch_problems(spec(topk=4), ["--attention-backend", "flashmla", "--page-size", "64"], MLA)
    assert "--page-size" in flags(probs)
    assert launch_problems(spec(topk=4), ["--attention-backend", "fa3", "--page-size", "64"], MLA) == []
    assert launch_problems(spec(topk=1), ["--attention-backend", "flashmla", "--page-size", "64"], MLA) == []


def test_no_backend_named_nothing_judged():
    assert launch_problems(spec(), ["python", "-m", "sglang.launch_server", "--model-path", "/m"], MLA) == []

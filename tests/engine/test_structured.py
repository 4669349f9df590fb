"""Grammar-constrained decoding (engine/structured.py): a random tiny model, which would
write anything, writes only what the constraint allows, in every engine path."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from ridgeline.engine import LLM, LLMEngine, SamplingParams, StructuredOutputs
from ridgeline.errors import EngineError

from tests.helpers.engine_fixtures import char_tokenizer, tiny_model

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
# llguidance's own options (x-guidance) in a schema apply: compact JSON, so that greedy
# decoding by a random model cannot spend its budget on whitespace
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
PROMPTS = ["hello", "a much longer prompt about colors", "x", "json please: "]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model("llama", vocab=len(tok), seed=4)


def engine(model, tok, **kw) -> LLMEngine:
    return LLMEngine.from_hf_model(model, tok, num_kv_blocks=kw.pop("num_kv_blocks", 300),
                                   max_model_len=kw.pop("max_model_len", 512), **kw)


def run(eng: LLMEngine, prompts: list[str], params: list[SamplingParams]) -> list:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(prompts))]


def sampled(constraint: StructuredOutputs, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_tokens": 200, "n": 3, "seed": 7, **kw},
                          structured_outputs=constraint)


def test_json_schema_outputs_parse_and_conform(model, tok):
    outs = run(engine(model, tok), PROMPTS, [sampled(StructuredOutputs(json=SCHEMA))] * 4)
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_and_lark_grammar(model, tok):
    eng = engine(model, tok)
    regex, choices = r"[0-9]{3}-[a-z]{2}", ["yes", "no", "maybe later"]
    lark = 'start: "ls " NAME (" " NAME)?\nNAME: /[a-z]{1,8}/\n'
    outs = run(eng, ["a", "b", "c"], [sampled(StructuredOutputs(regex=regex)),
                                      sampled(StructuredOutputs(choice=choices)),
                                      sampled(StructuredOutputs(grammar=lark))])
    assert all(re.fullmatch(regex, c.text) for c in outs[0].outputs)
    assert all(c.text in choices for c in outs[1].outputs)
    assert all(re.fullmatch(r"ls [a-z]{1,8}( [a-z]{1,8})?", c.text) for c in outs[2].outputs)


def test_logprobs_are_those_of_the_masked_distribution(model, tok):
    # The first character of "yes" / "no" is y or n: all the masked mass is on those two.
    out = run(engine(model, tok), ["q"], [SamplingParams(
        temperature=0, max_tokens=5, logprobs=5,
        structured_outputs=StructuredOutputs(choice=["yes", "no"]))])[0].outputs[0]
    first = out.top_logprobs[0]
    assert set(first) <= {tok.convert_tokens_to_ids("y"), tok.convert_tokens_to_ids("n")}
    assert math.isclose(sum(math.exp(v) for v in first.values()), 1.0, rel_tol=1e-4)
    assert out.logprobs[0] == max(first.values())


def test_unconstrained_neighbours_are_unchanged(model, tok):
    """A constrained request in the batch does not touch the others' logits."""
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = run(engine(model, tok), PROMPTS[:2], [plain, plain])
    mixed = run(engine(model, tok), PROMPTS[:2] + ["z"],
                [plain, plain, sampled(StructuredOutputs(json=SCHEMA))])
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids
                                                        for o in mixed[:2]]


def test_preemption_and_chunked_prefill_keep_the_grammar(model, tok):
    greedy = [SamplingParams(temperature=0, max_tokens=100,
                             structured_outputs=StructuredOutputs(json=COMPACT))] * 4
    roomy = run(engine(model, tok), PROMPTS, greedy)
    tight_eng = engine(model, tok, num_kv_blocks=40, block_size=4, max_model_len=150,
                       max_num_batched_tokens=16)
    tight = run(tight_eng, PROMPTS, greedy)
    assert tight_eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in tight] == [o.outputs[0].text for o in roomy]
    for o in tight:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_greedy_output_under_a_grammar(model, tok, method):
    """Drafts are checked against the grammar and each verified row is masked by the
    grammar's state after its draft prefix: the same greedy output as constrained
    decoding one token at a time, with proposals really verified (a draft that is the
    target itself proposes its unmasked choices: kept where the grammar agrees)."""
    params = SamplingParams(temperature=0, max_tokens=80,
                            structured_outputs=StructuredOutputs(json=COMPACT))
    plain = LLM.from_hf_model(model, tok, num_kv_blocks=300)
    spec = {"method": method, "num_speculative_tokens": 4, "adaptive": False, "ngram_min": 1}
    fast = LLM.from_hf_model(model, tok, num_kv_blocks=300, speculative=spec,
                             **({"draft_model": model} if method == "draft" else {}))
    a = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params)]
    b = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, params)]
    assert a == b
    stats = fast.engine.stats()
    assert stats.spec_proposed_tokens > 0 and stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("same_draft", [True, False])
def test_sampled_speculation_under_a_grammar_stays_valid(model, tok, same_draft):
    """Sampling with a draft model that drafts under the grammar too: every output
    conforms. A draft identical to the target has q = p on every row (both masked by the
    grammar's state after the same prefix), so every proposal is accepted; another draft
    gets both outcomes of verification."""
    draft = model if same_draft else tiny_model("llama", vocab=len(tok), seed=11)
    fast = LLM.from_hf_model(model, tok, num_kv_blocks=300, draft_model=draft, speculative={
        "method": "draft", "num_speculative_tokens": 4, "adaptive": False})
    outs = fast.generate(PROMPTS, sampled(StructuredOutputs(json=COMPACT), max_tokens=120))
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    stats = fast.engine.stats()
    if same_draft:
        assert stats.spec_proposed_tokens > 0 and stats.spec_acceptance_rate == 1.0
    else:
        assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens


@pytest.mark.parametrize("kwargs,words", [
    ({"regex": "a(b"}, "regex does not compile"),
    ({"grammar": "start: undefined_rule"}, "grammar constraint does not compile"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, "does not compile"),
    ({"json": "[1, 2]"}, "not a JSON schema object"),
    ({"choice": []}, "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
])
def test_a_bad_constraint_is_a_clear_error(model, tok, kwargs, words):
    eng = engine(model, tok)
    with pytest.raises(EngineError, match=words) as info:
        eng.add_request("r", "hi", SamplingParams(
            structured_outputs=StructuredOutputs(**kwargs)))
    assert info.value.param == "structured_outputs"
    assert not eng.has_unfinished_requests()


def test_a_model_without_a_tokenizer_refuses_constraints(model):
    eng = LLMEngine.from_hf_model(model, num_kv_blocks=64)
    with pytest.raises(EngineError, match="tokenizer"):
        eng.add_request("r", [5, 6, 7], SamplingParams(
            structured_outputs=StructuredOutputs(regex="a+")))

"""Grammar-constrained decoding (engine/structured.py) on SmolLM2-135M-Instruct: what a
JSON-schema constraint costs in speed, what compiling it costs, and how often the output
is valid with and without it.

    .venv/bin/python benchmarks/structured_bench.py --json
    .venv/bin/python benchmarks/structured_bench.py --quick --json

Speed: the same chat prompts (asking for JSON) decoded greedily for a fixed number of
tokens (EOS ignored, so both runs produce exactly as many tokens; the constrained run's
grammar is a schema whose strings are unbounded, so it never forces the end early), at
batch 1 and batch 32, constrained vs unconstrained, interleaved `--reps` times (medians),
in the same process:
`constrained_vs_unconstrained_b1` / `_b32` are the ratios of output tok/s (goal >= 0.9).
Compile: the first compile of each schema in a fresh compiler (ms), and the one-off
tokenizer set-up. Validity: for each schema, `--samples` answers at temperature 0.7
(seeded), each counted valid when its whole content parses as JSON and validates against
the schema (jsonschema); the same prompts with and without the constraint.
High-speed variant under a grammar: each schema's prompt decoded greedily with its own
constraint one request at a time, by the standard engine and by its `fast_variant()`
(speculation, checked against the grammar), interleaved `--reps` times:
`fast_constrained_speedup_b1` (ratio of output tok/s, medians) and
`fast_constrained_identical` (the greedy outputs are token for token the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from bench_common import machine

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "temperature_c": {"type": "number"},
        "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
    "todo_list": {"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "title": {"type": "string"}, "done": {"type": "boolean"}},
            "required": ["title", "done"], "additionalProperties": False},
            "minItems": 1, "maxItems": 4}},
        "required": ["items"], "additionalProperties": False},
    "tool_call": {"type": "object", "properties": {
        "name": {"const": "bash"},
        "arguments": {"type": "object", "properties": {"command": {"type": "string"}},
                      "required": ["command"], "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "string"},
        "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "author", "year", "tags"], "additionalProperties": False},
    "bool_answer": {"type": "object", "properties": {
        "answer": {"type": "boolean"}, "reason": {"type": "string"}},
        "required": ["answer", "reason"], "additionalProperties": False},
}
QUESTIONS = {
    "person": "Describe a person named Ada who is 36 years old.",
    "weather": "Report the weather in Oslo: 3 degrees and snowing.",
    "todo_list": "Make a to-do list with two items: buy milk (done) and call mom (not done).",
    "tool_call": "Call the bash tool to list the files in the current directory.",
    "book": "Describe the book Dune by Frank Herbert, published 1965.",
    "bool_answer": "Is the sky green? Answer and give a reason.",
}


def prompt_for(tok, name: str) -> str:
    schema = json.dumps(SCHEMAS[name])
    msg = (f"{QUESTIONS[name]}\nReply with only a JSON object that matches this JSON "
           f"schema, nothing else:\n{schema}")
    return tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                   add_generation_prompt=True)


def decode_rate(llm, prompts: list[str], constraint, tokens: int) -> float:
    from ridgeline.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=constraint)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4,
                                             structured_outputs=constraint))   # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def valid(text: str, schema: dict) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text.strip()), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    samples = 2 if args.quick else args.samples
    tokens = 32 if args.quick else args.tokens
    batch = 8 if args.quick else 32

    from ridgeline.engine import LLM, SamplingParams, StructuredOutputs
    from ridgeline.engine.structured import Grammars

    llm = LLM(model="default")
    tok = llm.tokenizer
    engine = llm.engine

    t0 = time.perf_counter()
    grammars = Grammars(tok, engine.model_config.vocab_size, sorted(engine.eos_token_ids))
    tokenizer_setup_ms = (time.perf_counter() - t0) * 1e3
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        grammars.grammar(StructuredOutputs(json=schema))
        compile_ms[name] = round((time.perf_counter() - t0) * 1e3, 2)

    # speed: a schema whose free strings never force the end (see module doc)
    free = StructuredOutputs(json={"type": "object", "properties": {
        "notes": {"type": "array", "items": {"type": "string"}}}, "required": ["notes"]})
    names = list(SCHEMAS)
    prompts = [prompt_for(tok, names[i % len(names)]) for i in range(batch)]
    rates = {}
    for label, n in (("b1", 1), (f"b{batch}", batch)):
        plain, held = [], []
        for _ in range(args.reps):   # interleaved, medians: the machine's drift hits both
            plain.append(decode_rate(llm, prompts[:n], None, tokens))
            held.append(decode_rate(llm, prompts[:n], free, tokens))
        p, h = statistics.median(plain), statistics.median(held)
        rates[label] = {"unconstrained_tok_s": round(p, 1), "constrained_tok_s": round(h, 1),
                        "ratio": round(h / p, 3)}

    from ridgeline.engine import LLMEngine
    fast = LLM(_engine=LLMEngine(engine.config.fast_variant()))
    greedy = [(prompt_for(tok, name), StructuredOutputs(json=schema))
              for name, schema in SCHEMAS.items()]

    def one_by_one(model) -> tuple[float, list[list[int]]]:
        outs, n, t0 = [], 0, time.perf_counter()
        for p, c in greedy:
            o = model.generate([p], SamplingParams(temperature=0, max_tokens=160,
                                                   structured_outputs=c))[0].outputs[0]
            outs.append(list(o.token_ids))
            n += len(o.token_ids)
        return n / (time.perf_counter() - t0), outs

    one_by_one(fast)   # warm: draft heads, first compiles
    std_rates, fast_rates, identical = [], [], True
    for _ in range(args.reps):
        r, a = one_by_one(llm)
        f, b = one_by_one(fast)
        std_rates.append(r)
        fast_rates.append(f)
        identical = identical and a == b
    fast_stats = fast.engine.stats()

    per_schema = {}
    for name, schema in SCHEMAS.items():
        p = prompt_for(tok, name)
        counts = {}
        for label, constraint in (("unconstrained", None),
                                  ("constrained", StructuredOutputs(json=schema))):
            outs = llm.generate([p], SamplingParams(temperature=0.7, max_tokens=160,
                                                    n=samples, seed=11,
                                                    structured_outputs=constraint))
            counts[label] = sum(valid(c.text, schema) for c in outs[0].outputs)
        per_schema[name] = counts
    n_total = samples * len(SCHEMAS)
    result = {
        "benchmark": "structured_bench", "model": "SmolLM2-135M-Instruct (default)",
        "library": "llguidance",
        "constrained_vs_unconstrained_b1": rates["b1"]["ratio"],
        f"constrained_vs_unconstrained_b{batch}": rates[f"b{batch}"]["ratio"],
        "speed": rates, "tokens_per_request": tokens,
        "tokenizer_setup_ms": round(tokenizer_setup_ms, 1),
        "compile_ms": compile_ms, "compile_ms_median": statistics.median(compile_ms.values()),
        "valid_rate_constrained": round(sum(c["constrained"] for c in per_schema.values())
                                        / n_total, 3),
        "valid_rate_unconstrained": round(sum(c["unconstrained"] for c in per_schema.values())
                                          / n_total, 3),
        "valid_per_schema": per_schema, "samples_per_schema": samples,
        "fast_constrained_speedup_b1": round(statistics.median(fast_rates)
                                             / statistics.median(std_rates), 3),
        "fast_constrained_tok_s": {"standard": round(statistics.median(std_rates), 1),
                                   "fast": round(statistics.median(fast_rates), 1)},
        "fast_constrained_identical": identical,
        "fast_acceptance_rate": fast_stats.spec_acceptance_rate,
        "machine": machine(),
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()

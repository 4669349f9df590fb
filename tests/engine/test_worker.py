"""The engine worker: the one thing that steps an engine, shared by threads and event
loops; pause / update_weights / resume for RL; and the scheduler's side of speculation."""

from __future__ import annotations

import threading
import time

import pytest

from ridgeline.engine import LLM, SamplingParams
from ridgeline.engine.core.block_manager import BlockManager
from ridgeline.engine.core.scheduler import Scheduler
from ridgeline.engine.core.worker import EngineUnavailableError
from ridgeline.engine.sequence import Sequence
from ridgeline.errors import EngineError
from tests.helpers.engine_fixtures import hf_greedy, random_prompts, tiny_model

PROMPTS = random_prompts(6, 512, seed=5, min_len=4, max_len=20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11)


def test_threads_sharing_one_llm_get_what_each_would_alone(model):
    llm = LLM.from_hf_model(model, num_kv_blocks=128, block_size=4)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        got[i] = llm.generate([PROMPTS[i]], GREEDY)[0].outputs[0].token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert alone[0] == hf_greedy(model, PROMPTS[0], 12)[0]


def test_final_only_handles_get_just_the_last_output_streaming_ones_every_step(model):
    llm = LLM.from_hf_model(model, num_kv_blocks=128, block_size=4)
    streamed = list(llm.worker.submit("s", PROMPTS[0], GREEDY))
    final = list(llm.worker.submit_many([("f", PROMPTS[0], GREEDY)], final_only=True)[0])
    assert len(streamed) == GREEDY.max_tokens and len(final) == 1
    assert final[0].finished
    assert final[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
    assert final[0].outputs[0].text == streamed[-1].outputs[0].text


def test_bad_request_in_a_batch_raises_and_aborts_the_rest(model):
    llm = LLM.from_hf_model(model, num_kv_blocks=128, block_size=4)
    with pytest.raises(EngineError, match="prompt_token_ids"):
        llm.generate([PROMPTS[0], [10**9]], GREEDY)
    deadline = time.monotonic() + 10
    while llm.worker.call(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not llm.worker.call(lambda e: e.has_unfinished_requests())
    assert llm.generate([PROMPTS[1]], GREEDY)[0].outputs[0].token_ids  # still serving


def test_pause_holds_in_flight_requests_and_resume_continues(model):
    llm = LLM.from_hf_model(model, num_kv_blocks=256, block_size=4)
    worker = llm.worker
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    handle = worker.submit("long", PROMPTS[2], long)
    stream = iter(handle)
    first = next(stream)
    worker.pause()
    frozen = worker.call(lambda e: e.num_generated_tokens)
    time.sleep(0.2)
    assert worker.call(lambda e: e.num_generated_tokens) == frozen  # nothing stepped
    assert worker.call(lambda e: e.has_unfinished_requests())       # still in flight
    assert not first.finished
    worker.resume()
    final = handle.result()
    assert len(final.outputs[0].token_ids) == 200
    assert final.outputs[0].token_ids == hf_greedy(model, PROMPTS[2], 200)[0]


def test_update_weights_between_steps_changes_what_is_generated(model):
    new = tiny_model("llama", seed=12)
    llm = LLM.from_hf_model(model, num_kv_blocks=128, block_size=4)
    before = llm.generate([PROMPTS[3]], GREEDY)[0]
    assert before.outputs[0].token_ids == hf_greedy(model, PROMPTS[3], 12)[0]
    worker = llm.worker
    worker.pause()
    n = worker.update_weights(new.named_parameters())
    worker.resume()
    assert n == len(list(new.named_parameters()))
    after = llm.generate([PROMPTS[3]], GREEDY)[0]
    # the prefix cache of the old weights was dropped: nothing is reused, all recomputed
    assert after.num_cached_tokens == 0
    assert after.outputs[0].token_ids == hf_greedy(new, PROMPTS[3], 12)[0]


def test_update_weights_while_requests_run_keeps_them_going(model):
    new = tiny_model("llama", seed=12)
    llm = LLM.from_hf_model(model, num_kv_blocks=256, block_size=4)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    handle = llm.worker.submit("r", PROMPTS[4], long)
    next(iter(handle))
    llm.worker.update_weights(new.named_parameters())   # no pause: between two steps
    out = handle.result().outputs[0]
    assert len(out.token_ids) == 120
    # the first tokens came from the old weights, later ones from the new
    old_run = hf_greedy(model, PROMPTS[4], 120)[0]
    assert out.token_ids[0] == old_run[0] and out.token_ids != old_run


def test_call_on_a_stopped_worker_is_a_clear_error(model):
    llm = LLM.from_hf_model(model, num_kv_blocks=64, block_size=4)
    llm.worker.stop()
    with pytest.raises(EngineUnavailableError, match="not running"):
        llm.worker.submit("x", PROMPTS[0], GREEDY)


# -- the scheduler owns look-ahead slots and num_computed_tokens ---------------------------

def _decoding_seq(bm: BlockManager, sched: Scheduler, n_prompt: int) -> Sequence:
    seq = Sequence("s", 0, list(range(1, n_prompt + 1)), n_prompt, SamplingParams())
    sched.add(seq)
    out = sched.schedule()
    sched.update_from_output(out, {})
    seq.token_ids.append(99)  # the sampled token: now one token to decode
    return seq


def test_lookahead_slots_are_reserved_then_rejected_ones_given_back():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = _decoding_seq(bm, sched, 6)               # 6 tokens of KV: 2 blocks
    assert seq.num_computed_tokens == 6 and len(seq.block_table) == 2
    seq.num_lookahead = 5                           # the speculator's plan
    out = sched.schedule()
    assert out.scheduled == [(seq, 1)] and out.lookahead == {seq: 5}
    assert len(seq.block_table) == 3                # 6 computed + 1 + 5 -> 12: 3 blocks
    assert seq.num_lookahead == 0                   # the plan is used up
    sched.update_from_output(out, {seq: 1})         # one of five proposals kept
    assert seq.num_computed_tokens == 8             # 6 + the scheduled one + 1 kept
    assert len(seq.block_table) == 2                # the block of rejected slots is back
    seq.token_ids.extend([1, 2])
    free_before = bm.num_free_blocks
    seq.num_lookahead = 6                           # 8 computed + 1 + 6 -> 15: 4 blocks
    out = sched.schedule()
    assert out.lookahead == {seq: 6} and bm.num_free_blocks == free_before - 2
    sched.update_from_output(out, {})               # nothing verified after all
    assert seq.num_computed_tokens == 9             # the decoded token's block stays
    assert bm.num_free_blocks == free_before - 1


def test_lookahead_refused_when_the_pool_is_short():
    bm = BlockManager(num_blocks=3, block_size=4)    # block 0 is reserved: 2 usable
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    seq = _decoding_seq(bm, sched, 6)
    seq.num_lookahead = 8                            # would need 2 more blocks
    free = bm.num_free_blocks
    out = sched.schedule()
    assert out.scheduled == [(seq, 1)] and not out.lookahead   # it just decodes
    assert bm.num_free_blocks == free and len(seq.block_table) == 2


def test_lookahead_takes_only_the_budget_admissions_leave():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=10)
    seq = _decoding_seq(bm, sched, 6)
    seq.num_lookahead = 7
    newcomer = Sequence("new", 0, list(range(20, 26)), 6, SamplingParams())
    sched.add(newcomer)
    out = sched.schedule()
    assert out.scheduled == [(seq, 1), (newcomer, 6)]
    assert out.lookahead == {seq: 3}                 # 10 - 1 - 6


def test_tokens_carry_the_weights_version_they_were_sampled_under(model):
    new = tiny_model("llama", seed=12)
    llm = LLM.from_hf_model(model, num_kv_blocks=256, block_size=4)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_versions == [0] * 12
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    handle = llm.worker.submit("v", PROMPTS[5], long)
    first = next(iter(handle)).outputs[0]
    llm.worker.update_weights(new.named_parameters(), version=7)
    out = handle.result().outputs[0]
    versions = out.token_versions
    assert len(versions) == 80 and versions[:len(first.token_ids)] == [0] * len(first.token_ids)
    assert versions[-1] == 7 and sorted(versions) == versions  # 0...0 then 7...7
    assert set(versions) == {0, 7}
    assert llm.worker.call(lambda e: e.policy_version) == 7

"""The chat-question answer checks that the precision and KV-dtype tests share: the 24
questions, greedy at 32 tokens, each prompt run alone or all in one batch, and the
log-probability gap at the first token where two answers part (a near tie is <= `NEAR_TIE`
nats on the asking path)."""

from __future__ import annotations

import json

from kvloop import LLM, SamplingParams
from kvloop.bench.quality import CHAT_QUESTIONS

QUESTIONS = json.loads(CHAT_QUESTIONS.read_text())
MAX_TOKENS = 32
NEAR_TIE = 0.1
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def run_alone(llm: LLM, prompt: list[int]) -> list[int]:
    """`prompt`'s greedy answer, the only request in its steps."""
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def run_batched(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts' greedy answers, all submitted in one `generate` call."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def logprob_gap(llm: LLM, prompt: list[int], ours: list[int], theirs: list[int]) -> float:
    """|logprob(ours) - logprob(theirs)| at their first difference, on `llm`'s path."""
    i = next(j for j, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    out = llm.generate([{"prompt_token_ids": prompt + ours[:i]}], params, use_tqdm=False)
    top = out[0].outputs[0].logprobs[0]
    assert ours[i] in top and theirs[i] in top, "a divergence outside the path's top 20"
    return abs(top[ours[i]].logprob - top[theirs[i]].logprob)

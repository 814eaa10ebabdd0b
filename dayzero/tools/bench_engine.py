"""The in-process target of ``dayzero bench``: requests go straight into an ``LLM``'s engine, and this
module runs the engine's step loop itself, so every token is seen at the end of the step that made it.
One short request runs before the clock starts (not counted).

Runs on the calling thread, the one that loaded the model: torch's CPU thread pool belongs to the thread
that first runs an op, and stepping on another one is much slower on small machines.
"""
from __future__ import annotations

import time
from collections import deque

from dayzero.engine.sampling_params import SamplingParams
from dayzero.tools.bench_report import Result
from dayzero.tools.bench_workload import Job, PromptSource


def prompt_source(llm) -> PromptSource:
    tok = llm.tokenizer
    return PromptSource(llm.engine.model_config.vocab_size, frozenset(tok.all_special_ids if tok else ()), tok)


def encode(llm, job: Job) -> list[int]:
    """The prompt as the server would tokenize it (chat template, no added special tokens)."""
    if job.ids is not None:
        return list(job.ids)
    tok = llm.tokenizer
    if tok is None:
        raise ValueError("this checkpoint has no tokenizer: give prompts as token ids")
    text = job.text
    if job.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise ValueError("this checkpoint has no chat template: give prompts as text or token ids")
        text = tok.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def run(llm, jobs: list[Job], params: list, arrivals: list[float], concurrency: int | None,
        progress) -> tuple[list[Result], float, dict[str, int]]:
    """Returns the results in job order, the seconds from the first arrival to the last token, and the
    engine's queue and cache use after the run."""
    eng = llm.engine
    results = [Result(j.output_len) for j in jobs]
    prompts: list[list[int] | None] = []
    for job, res in zip(jobs, results):  # tokenized before the clock starts, like a client that has them ready
        try:
            prompts.append(encode(llm, job))
        except ValueError as e:
            prompts.append(None)
            res.error = str(e)
    pending = deque(i for i in sorted(range(len(jobs)), key=arrivals.__getitem__) if prompts[i] is not None)
    if pending:  # one short request first, so that one-time costs of the first steps are not in the numbers
        llm.generate([{"prompt_token_ids": prompts[pending[0]][:16]}], SamplingParams(max_tokens=2, ignore_eos=True))
    for r in results:
        if r.error:
            progress.update()
    cap = concurrency or len(jobs)
    live: dict[str, int] = {}
    start: dict[int, float] = {}
    last: dict[int, float] = {}
    t0 = step_end = time.perf_counter()
    room = cap  # places free while the last step ran: requests that arrived then waited only for the step
    try:
        while pending or live:
            now = time.perf_counter()
            while pending and len(live) < cap and t0 + arrivals[pending[0]] <= now:
                i = pending.popleft()
                arrived = t0 + arrivals[i]
                start[i] = arrived if room > 0 else max(arrived, step_end)
                room -= 1
                rid = f"bench-{i}"
                try:
                    eng.add_request(rid, prompts[i], params[i])
                except ValueError as e:
                    results[i].error = str(e)
                    progress.update()
                    continue
                results[i].prompt_tokens = len(prompts[i])
                live[rid] = i
            if not live:
                if pending:  # idle until the next arrival
                    time.sleep(max(0.0, t0 + arrivals[pending[0]] - time.perf_counter()))
                continue
            room = cap - len(live)
            outs = eng.step()
            step_end = time.perf_counter()
            for out in outs:
                i = live.get(out.request_id)
                if i is None:
                    continue
                res, o = results[i], out.outputs[0]
                if len(o.token_ids) > res.output_tokens:
                    if res.ttft is None:
                        res.ttft = step_end - start[i]
                    else:
                        res.itl.append(step_end - last[i])
                    last[i] = step_end
                    res.output_tokens = len(o.token_ids)
                if out.finished:
                    del live[out.request_id]
                    res.e2e = step_end - start[i]
                    if o.finish_reason == "error":
                        res.error = "the model produced NaN or infinite logits"
                    short = o.finish_reason != "length" or res.output_tokens != res.expected_tokens
                    res.truncated = not res.error and short
                    progress.update()
            if live and not eng.has_unfinished():
                for rid, i in live.items():
                    results[i].error = "the engine dropped the request"
                    progress.update()
                live.clear()
    finally:
        for rid in live:  # interrupted: leave nothing behind in the engine
            eng.abort(rid)
    duration = max((start[i] + r.e2e for i, r in enumerate(results) if r.e2e is not None), default=t0) - t0
    s = eng.stats()
    after = {"requests_running": s["running"], "requests_waiting": s["waiting"],
             "cache_blocks_used": s["blocks_total"] - s["blocks_free"],
             "state_slots_used": s["slots_total"] - s["slots_free"]}
    return results, duration, after

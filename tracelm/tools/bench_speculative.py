"""`tracelm bench speculative`: plain greedy decoding against prompt-lookup speculation on prompts whose
answers repeat their context (editing code, summarising a text), in one process, with the same tokens."""

from __future__ import annotations

import time
from typing import Any

import attrs

from tracelm.session import Session, chat_prompt
from tracelm.state.records import SamplingParams
from tracelm.tools.bench import open_session

FUNCTION = '''def summarize_orders(orders, tax_rate=0.2):
    """Total, average and largest order value, with tax, of a list of order dicts."""
    total = 0.0
    largest = None
    count = 0
    for order in orders:
        if order.get("cancelled"):
            continue
        value = order["quantity"] * order["unit_price"]
        value = value * (1 + tax_rate)
        total += value
        count += 1
        if largest is None or value > largest:
            largest = value
    average = total / count if count else 0.0
    return {"total": round(total, 2), "average": round(average, 2), "largest": largest}
'''

ARTICLE = (
    "The city council voted on Tuesday to extend the night bus service to the eastern suburbs from next "
    "spring. The new line will run every twenty minutes between midnight and five in the morning, linking "
    "the central station with the hospital, the university campus and the industrial park. Council members "
    "said the decision followed a survey in which more than four thousand residents, most of them shift "
    "workers and students, asked for safer ways to travel home late at night. The extension will cost about "
    "two million euros a year, paid for partly by a small increase in parking fees in the city centre and "
    "partly by a grant from the regional transport authority. Opposition members supported the plan but "
    "asked the council to publish ridership figures after the first six months, so that the service can be "
    "adjusted if demand turns out lower than expected."
)

TASKS = {
    "code_edit": "Here is a Python function:\n\n```python\n" + FUNCTION + "```\n\nRewrite the function with the "
                 "parameter `tax_rate` renamed to `vat`. Reply with the complete function only.",
    "summarize": "Summarize the following news article in a few sentences, keeping its key facts and "
                 "wording.\n\n" + ARTICLE,
}


def speculative_bench(model_name: str, draft_tokens: int = 15, ngram: int = 8, n_decode: int = 128,
                      repeats: int = 2, **engine: Any) -> dict[str, Any]:
    """For each task: greedy decode of up to n_decode tokens plainly and with prompt-lookup drafts of up
    to `draft_tokens`, alternating, best of `repeats` each; the texts must be identical."""
    with open_session(model_name, **engine) as plain:
        spec = attrs.evolve(plain.cfg.speculative, draft_tokens=draft_tokens, ngram=ngram)
        sessions = {"plain": plain, "speculative": Session(plain.model, attrs.evolve(plain.cfg, speculative=spec))}
        return _speculative_bench(sessions, draft_tokens, ngram, n_decode, repeats)


def _speculative_bench(sessions: dict[str, Session], draft_tokens: int, ngram: int, n_decode: int, repeats: int
                       ) -> dict[str, Any]:
    model = sessions["plain"].model
    greedy = SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
    report: dict[str, Any] = {"model": model.path.name, "draft_tokens": draft_tokens, "ngram": ngram}
    for task, text in TASKS.items():
        ids = chat_prompt(model, [{"role": "user", "content": text}])
        runs: dict[str, dict[str, Any]] = {}
        for _ in range(repeats):
            for mode, session in sessions.items():
                runner = session.new_runner(len(ids) + n_decode + 1)
                t0 = time.perf_counter()
                out = "".join(runner.generate(ids, n_decode, greedy))
                s = runner.stats
                rate = s.n_generated / s.decode_seconds if s.decode_seconds else 0.0
                if mode not in runs or rate > runs[mode]["tok_s"]:
                    runs[mode] = {"tok_s": rate, "text": out, "stats": s, "seconds": time.perf_counter() - t0}
        plain, spec = runs["plain"], runs["speculative"]
        s = spec["stats"]
        report[task] = {
            "prompt_tokens": len(ids),
            "generated": s.n_generated,
            "plain_tok_s": round(plain["tok_s"], 2),
            "speculative_tok_s": round(spec["tok_s"], 2),
            "speedup": round(spec["tok_s"] / plain["tok_s"], 3) if plain["tok_s"] else None,
            "tokens_per_pass": round(s.n_generated / max(s.n_passes, 1), 2),
            "drafted": s.n_drafted,
            "accepted": s.n_accepted,
            "acceptance": round(s.n_accepted / s.n_drafted, 3) if s.n_drafted else None,
            "identical_text": plain["text"] == spec["text"],
            "text_head": spec["text"][:120],
        }
    return report

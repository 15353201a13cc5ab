"""Between vLLM's values and the protocol's: a ``Sampling`` as vLLM's sampling parameters, a request
output as its new tokens and logprobs, and a request's drained rows as the protocol's. Plain functions,
apart from the session's bookkeeping of its requests."""

from __future__ import annotations

from typing import Callable, Mapping

from inspector.core.protocol import Rows, Sampling
from inspector.core.run import TopToken


def sampling_params(s: Sampling, skip_cache: bool = False):
    """vLLM's parameters for ``s``. Not detokenised by vLLM: the session makes each token's text once,
    where vLLM's detokeniser works per request and token on the engine's step. ``skip_cache``: read no
    cached block (a capturing request under prefix caching needs every row)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                              top_k=s.top_k if s.top_k > 0 else -1, seed=s.seed, logprobs=s.logprobs or None,
                              ignore_eos=s.ignore_eos, output_kind=RequestOutputKind.DELTA, detokenize=False,
                              skip_reading_prefix_cache=skip_cache)
    except Exception as e:  # noqa: BLE001 - vLLM's rules beyond ours (its errors are not all ValueErrors)
        raise ValueError(f"sampling refused: {e}") from None


def new_tokens(out, text: Callable[[int], str]) -> dict:
    """A request output's new tokens as ``RequestStep`` fields: ids, texts (``text`` of each id), the
    chosen tokens' logprobs and the top logprobs of each step."""
    completion = out.outputs[0]
    new_ids = tuple(completion.token_ids)
    if not completion.logprobs:  # none asked for (a batch-256 step makes 256 of these)
        return {"new_token_ids": new_ids, "new_texts": tuple(map(text, new_ids))}
    chosen, tops = [], []
    for token, entry in zip(new_ids, completion.logprobs):
        chosen.append(float(entry[token].logprob) if token in entry else float("nan"))
        ranked = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1])
        tops.append(tuple(TopToken(t, lp, text(t)) for t, lp in ranked))
    return {"new_token_ids": new_ids, "new_texts": tuple(text(t) for t in new_ids),
            "logprobs": tuple(chosen), "top_logprobs": tuple(tops)}


def drained_rows(rows: Mapping[str, dict]) -> dict[str, Rows]:
    """A request's drained rows by hook as the protocol's (positions, token ids, values)."""
    return {hook: (c["positions"], c["token_ids"], c["values"]) for hook, c in rows.items()}
